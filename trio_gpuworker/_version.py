"""The package's version: setup.py reads it from here, `trio_gpuworker.__version__` re-exports it."""

__version__ = "0.1.0"
