"""The HTTP listeners' settings: hypercorn's configuration for one bind, and the Unix socket's file."""

from __future__ import annotations

import logging
import math
import os
import socket
import stat
from pathlib import Path

from hypercorn.config import Config as HypercornConfig

from .._errors import ConfigError
from .config import HttpConfig

READ_TIMEOUT_SLACK_S = 5.0
API_SOCKET_MODE = 0o660


def hypercorn_config(bind: str, graceful_timeout_s: float, http: HttpConfig | None = None) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [bind]
    if http is not None:
        # A backstop for a connection that sends nothing at all: hypercorn's read timeout also runs while a
        # request is being served, so it must exceed the body timeout plus the longest request. Stalled and
        # dribbled bodies are cut by the app (http.body_timeout_s), idle keep-alive by keep_alive_timeout.
        hc.read_timeout = math.ceil(http.body_timeout_s + http.request_timeout_s + READ_TIMEOUT_SLACK_S)
        hc.keep_alive_timeout = http.keep_alive_s
    if bind.startswith("unix:"):
        hc.umask = 0o117  # the API socket is 0660 from the moment it exists
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = graceful_timeout_s
    return hc


def prepare_unix_socket(path: Path) -> None:
    """Create the parent directory; remove a stale socket file, refuse one a live daemon listens on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"http.unix_socket: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(os.fspath(path))
    except OSError:
        path.unlink(missing_ok=True)  # nobody listens: a leftover of a daemon that was killed
    else:
        raise ConfigError(f"http.unix_socket: another daemon is listening on {path}")
    finally:
        probe.close()


__all__ = ["API_SOCKET_MODE", "READ_TIMEOUT_SLACK_S", "hypercorn_config", "prepare_unix_socket"]
