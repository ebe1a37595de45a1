"""The sidecar: health, engine truth, fix manifest and metrics next to vLLM."""
