"""An engine as the worker process a lane spawns (docs/engines.md, 'Running it under the daemon')."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import trio

from .._compute import ComputeThread
from .._cores import ledger
from .._engine_server import EngineServer, serve_socket
from .._lifeline import watch_lifeline
from ._base import Engine


def serve(engine: Engine, argv: Sequence[str] | None = None) -> int:
    """Serve `engine` on the daemon's socket until SHUTDOWN or until the daemon goes; return the exit code.

    `argv` (default: the process's arguments) holds the `--socket PATH --nonce HEX` a lane appends to its
    `worker_command`. The process dies with the daemon however the daemon ends (its lifeline), and its methods run
    on one compute thread of their own."""
    parser = argparse.ArgumentParser(description=f"the {engine.name} engine, a trio-gpuworker worker")
    parser.add_argument("--socket", required=True, help="the daemon's listening Unix socket for this worker")
    parser.add_argument("--nonce", required=True, help="spawn nonce to present in HELLO (hex)")
    args = parser.parse_args(argv)
    watched = watch_lifeline()  # first: from here on this worker cannot outlive its daemon
    cores = ledger()  # its jobs count in the node's core ledger, as the built-in worker's do (_cores.py)
    compute = ComputeThread(f"engine-{engine.name}", on_busy=cores.busy if cores is not None else None)
    return trio.run(serve_socket, lambda stream: EngineServer(engine, stream, args.nonce, compute, watched),
                    args.socket)


__all__ = ["serve"]
