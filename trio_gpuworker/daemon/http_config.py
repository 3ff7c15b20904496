"""The [http] table: listeners, limits, API keys and which routes are open without one."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from .http_auth import KEYS_ENV, load_api_keys

DEFAULT_LISTEN = "127.0.0.1:8421"
UNIX_PATH_MAX = 107
# The routes an orchestrator and a scraper call without a key, unless http.open_routes says otherwise
PROBE_ROUTES = ("/livez", "/readyz", "/healthz", "/health", "/metrics")  # /health: TEI's and vLLM's


@dataclass(frozen=True)
class HttpConfig:
    listen: str = DEFAULT_LISTEN  # host:port on loopback; "" disables TCP
    unix_socket: str = ""  # path of a Unix-socket listener (mode 0660); "" disables it
    admin_on_tcp: bool = False  # admin routes (reload, drain, load, unload) on the TCP listener too
    allow_remote: bool = False  # let `listen` name a non-loopback address (needs API keys, or insecure_no_auth)
    max_body_bytes: int = 8 << 20
    request_timeout_s: float = 120.0
    max_inputs: int = 2048
    body_timeout_s: float = 30.0  # the whole request body must arrive within this (408 and close otherwise)
    # an idle keep-alive connection is closed after this (hypercorn's default). Behind a proxy or load balancer
    # that reuses connections, set it above the balancer's idle timeout: else the balancer may send a request on
    # a connection the daemon is closing, and its client gets a 502
    keep_alive_s: float = 5.0
    max_connections_per_client: int = 128  # POST requests in flight per client address on TCP (429 beyond)
    api_keys_file: str = ""  # one bearer token per line; with $GPUWORKER_API_KEYS, TCP requests need one
    insecure_no_auth: bool = False  # allow_remote without keys, said explicitly
    open_routes: tuple[str, ...] = PROBE_ROUTES  # served on TCP without a key (a subset of PROBE_ROUTES)
    # sha256 digests of the keys (from the file and the environment; never a TOML key)
    api_keys: frozenset[bytes] = field(default=frozenset(), repr=False)


def check_listen(listen: str, allow_remote: bool) -> None:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536 or not host:  # 0: any free port
        raise ConfigError(f"http.listen: {listen!r} is not host:port")
    if allow_remote:
        return
    bare = host.strip("[]")
    try:
        loopback = bare == "localhost" or ipaddress.ip_address(bare).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(f"http.listen: {listen!r} is not a loopback address (set http.allow_remote = true, with "
                          "API keys, to listen there)")


def parse_http(raw: Any, base: Path, env: Mapping[str, str],
               table: Callable[[str, Any, type], Any]) -> HttpConfig:
    """`table` builds the flat fields (config.py's `_table`: unknown keys and wrong types name the key)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"http: expected a table, got {raw!r}")
    raw = dict(raw)
    if "api_keys" in raw:
        raise ConfigError(f"http.api_keys: keys are not written in the configuration; put them in "
                          f"http.api_keys_file or ${KEYS_ENV}")
    routes = raw.pop("open_routes", list(PROBE_ROUTES))
    if not isinstance(routes, list) or not all(isinstance(r, str) and r in PROBE_ROUTES for r in routes):
        raise ConfigError(f"http.open_routes: expected a list of routes among {', '.join(PROBE_ROUTES)}, "
                          f"got {routes!r}")
    http = table("http", raw, HttpConfig)
    http = replace(http, listen=env.get("GPUWORKER_LISTEN", http.listen),
                   unix_socket=env.get("GPUWORKER_UNIX_SOCKET", http.unix_socket), open_routes=tuple(routes),
                   api_keys=load_api_keys(http.api_keys_file, base, env))
    if http.listen:
        check_listen(http.listen, http.allow_remote)
    if http.allow_remote and not http.api_keys and not http.insecure_no_auth:
        raise ConfigError(f"http.allow_remote: a listener other hosts can reach needs API keys "
                          f"(http.api_keys_file or ${KEYS_ENV}); set http.insecure_no_auth = true to serve it "
                          "without authentication")
    if http.insecure_no_auth and http.api_keys:
        raise ConfigError(f"http.insecure_no_auth: API keys are configured (http.api_keys_file or ${KEYS_ENV}); "
                          "drop one or the other")
    if http.unix_socket:
        if len(os.fsencode(http.unix_socket)) > UNIX_PATH_MAX:
            raise ConfigError(f"http.unix_socket: {http.unix_socket!r} is longer than the {UNIX_PATH_MAX}-byte "
                              "limit of a Unix socket path")
        if not os.path.isabs(http.unix_socket):
            http = replace(http, unix_socket=os.fspath(base / http.unix_socket))
    if not http.listen and not http.unix_socket:
        raise ConfigError("http: set listen and/or unix_socket")
    for name, lo in (("max_body_bytes", 1024), ("max_inputs", 1), ("max_connections_per_client", 1)):
        if getattr(http, name) < lo:
            raise ConfigError(f"http.{name}: must be >= {lo}, got {getattr(http, name)}")
    for name in ("request_timeout_s", "body_timeout_s", "keep_alive_s"):
        if getattr(http, name) <= 0:
            raise ConfigError(f"http.{name}: must be > 0, got {getattr(http, name)}")
    return http
