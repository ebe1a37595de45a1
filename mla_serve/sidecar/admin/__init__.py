"""The admin port: health, status, metrics, the fix manifest, the canary."""
