"""The patch engine: fix catalog, series application, probes and manifest."""
