"""The daemon: TOML configuration, HTTP API, entry point (gpuworkerd)."""
