"""The engine side: the typed per-rank contract, the vLLM plugin that writes it, the
readers of its files and of vLLM's log. Imported into every vLLM process by the plugin: it
loads nothing of the patch engine or the sidecar."""
