"""The tinygrad worker process (`python -m trio_gpuworker.worker`): the engine server (`_engine_server.py`) around
the tinygrad engine, an Engine of `trio_gpuworker.engine`, plus the data plane. Its modules are the worker's own,
not an API."""
