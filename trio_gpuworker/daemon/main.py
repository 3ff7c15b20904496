"""gpuworkerd entry point: config, logging, supervisor, HTTP listeners, signals."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from .._errors import ConfigError
from ..supervisor import Supervisor
from .config import DaemonConfig, load_config
from .http import Api

log = logging.getLogger("trio_gpuworker.daemon")


def setup_logging(fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def hypercorn_config(cfg: DaemonConfig) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = []
    if cfg.http.listen:
        hc.bind.append(cfg.http.listen)
    if cfg.http.unix_socket:
        hc.bind.append(f"unix:{cfg.http.unix_socket}")
        hc.umask = 0o117  # the API socket is 0660
    hc.accesslog = None
    hc.graceful_timeout = cfg.supervisor.windows.shutdown_s
    return hc


async def run_daemon(cfg: DaemonConfig, *,
                     task_status: trio.TaskStatus[tuple[Supervisor, list[str]]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until SIGTERM/SIGINT: then stop admitting, finish what is in flight, stop workers, return.

    Started value: (supervisor, the bound listener URLs)."""
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def wait_signal() -> None:
                async for signum in signals:
                    log.info("received %s: draining", signal.Signals(signum).name)
                    stop.set()
                    return

            nursery.start_soon(wait_signal)
            async with Supervisor(cfg.supervisor) as sup:
                binds = await nursery.start(lambda task_status: serve(Api(sup, cfg.http), hypercorn_config(cfg),
                                                                      shutdown_trigger=stop.wait,
                                                                      task_status=task_status))
                log.info("gpuworkerd ready: %s; lanes %s", ", ".join(binds), ", ".join(sup.lanes))
                task_status.started((sup, binds))
                await stop.wait()
                sup.close()
            nursery.cancel_scope.cancel()
    log.info("gpuworkerd stopped")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpuworkerd", description="trio-gpuworker node daemon")
    p.add_argument("--config", type=Path, default=None, help="TOML config (default: the embedded default)")
    p.add_argument("--check-config", action="store_true", help="validate the configuration and exit")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"gpuworkerd: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        print(f"configuration OK: {len(cfg.supervisor.lanes)} lane(s), {len(cfg.supervisor.models)} model(s)")
        return 0
    setup_logging(cfg.log_format)
    os.umask(0o077)
    try:
        trio.run(run_daemon, cfg)
    except ConfigError as exc:
        log.error("configuration error: %s", exc)
        return 2
    return 0
