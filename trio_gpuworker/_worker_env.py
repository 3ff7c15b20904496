"""The environment a worker starts with: the names the daemon sets (supervisor/_spawn.py, supervisor/_arena.py)
and the worker reads, defined once here. The lifeline's is in _lifeline.py, beside the code on both ends."""

from __future__ import annotations

DEVICE = "DEV"  # tinygrad's device
KERNEL_CACHE = "CACHEDB"  # tinygrad's kernel cache (sqlite), shared by the workers of one state directory
JIT_CACHE = "GPUWORKER_JIT_CACHE"  # the captured-JIT cache directory (worker/_jitfile.py)
WORKER_ID = "GPUWORKER_WORKER_ID"  # "<lane>.<generation>"
LANE_ID = "GPUWORKER_LANE_ID"
ARENA_FD = "GPUWORKER_ARENA_FD"  # the shared memfd the rings live in, inherited
ARENA_BYTES = "GPUWORKER_ARENA_BYTES"
NICE = "GPUWORKER_NICE"  # added to the worker's niceness at start (the background tuner's: 19)
CPUS = "GPUWORKER_CPUS"  # the cores it may run on, "0,1" (the background tuner's: one core)
CORES = "GPUWORKER_CORES"  # the node's core ledger, shared by the daemon's workers (_cores.py)

__all__ = ["ARENA_BYTES", "ARENA_FD", "CORES", "CPUS", "DEVICE", "JIT_CACHE", "KERNEL_CACHE", "LANE_ID", "NICE",
           "WORKER_ID"]
