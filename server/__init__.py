"""mla-serve: a pinned vLLM with the sparse-MLA fixes, a sidecar that tells the truth, and charts."""

__version__ = "0.1.0"
