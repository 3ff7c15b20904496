"""python -m trio_gpuworker.worker --socket PATH --nonce HEX"""

from __future__ import annotations

import argparse
import sys


def prewarm() -> None:
    """tinygrad's import and device start (~0.9 s on CPU, ~0.45 s with the device's helper programs restored from
    the kernel cache's folder), begun on the compute thread at spawn so they overlap the worker's own imports and
    handshake instead of following the first LOAD. DEV is set by the daemon."""
    import os
    from pathlib import Path

    from .._worker_env import KERNEL_CACHE
    from ._kernelcache import check_kernel_cache

    if db := os.environ.get(KERNEL_CACHE):
        if why := check_kernel_cache(Path(db)):
            print(f"worker: kernel cache {db} moved aside ({why}); kernels will be recompiled", file=sys.stderr)
    from ._devicecache import open_device

    open_device(Path(db).parent if db else None)  # opening the device is the point (its helpers kept by the cache)
    from ..models import bert, llama  # noqa: F401


def lower_priority() -> None:
    """GPUWORKER_NICE and GPUWORKER_CPUS, before any thread or compiler process starts: they inherit both."""
    import os

    from .._worker_env import CPUS, NICE

    if nice := os.environ.get(NICE):
        os.nice(int(nice))
    if cpus := os.environ.get(CPUS):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trio_gpuworker.worker", description=__doc__)
    p.add_argument("--socket", required=True, help="the daemon's listening Unix socket for this worker")
    p.add_argument("--nonce", required=True, help="spawn nonce to present in HELLO (hex)")
    args = p.parse_args(argv)
    from .._lifeline import watch_lifeline

    watched = watch_lifeline()  # first: from here on this worker cannot outlive its daemon
    lower_priority()
    from .._compute import ComputeThread
    from .._cores import ledger

    # tinygrad work stays on this one thread (see _compute), the prewarm included; its jobs count in the node's
    # core ledger, which fused kernels ask for their threads each step (_cores.py)
    cores = ledger()
    compute = ComputeThread(on_busy=cores.busy if cores is not None else None)
    compute.submit(prewarm)
    import trio

    from ._server import serve

    return trio.run(serve, args.socket, args.nonce, compute, watched)


if __name__ == "__main__":
    sys.exit(main())
