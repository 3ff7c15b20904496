"""python -m trio_gpuworker.worker --socket PATH --nonce HEX"""

from __future__ import annotations

import argparse
import sys

import trio

from ._server import serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trio_gpuworker.worker", description=__doc__)
    p.add_argument("--socket", required=True, help="the daemon's listening Unix socket for this worker")
    p.add_argument("--nonce", required=True, help="spawn nonce to present in HELLO (hex)")
    args = p.parse_args(argv)
    return trio.run(serve, args.socket, args.nonce)


if __name__ == "__main__":
    sys.exit(main())
