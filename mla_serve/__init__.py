"""mla-serve: a pinned vLLM with the sparse-MLA fixes, a truthful sidecar, and Helm charts."""

__version__ = "0.1.0"
