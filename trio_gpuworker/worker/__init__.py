"""The worker process: protocol v3 server loop around a tinygrad engine (see __main__)."""
