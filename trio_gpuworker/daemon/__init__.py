"""The daemon: TOML configuration, HTTP API, entry point (gpuworkerd). A program of one's own embeds the Supervisor
through `trio_gpuworker` and may read the daemon's TOML with `daemon.config.load_config` (README, 'Python API'); the
other modules are the daemon's own, not an API."""
