"""sd_notify(3) without libsystemd: one AF_UNIX datagram per state change to $NOTIFY_SOCKET.

    n = Notifier.from_env(os.environ, unset=True)   # workers must not inherit the socket
    n.notify("READY=1", "STATUS=serving 2/2 lanes")
    n.watchdog_interval_s                           # $WATCHDOG_USEC / 2, None when systemd set no watchdog

A path starting with '@' is an abstract socket. Sending never blocks and never raises: a lost
notification must not take the daemon down (systemd would then notice the missing READY or WATCHDOG).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import MutableMapping

log = logging.getLogger("trio_gpuworker.notify")

NOTIFY_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address or None
        self.watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self.sent: list[str] = []  # the last few messages, for logs and tests
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, env: MutableMapping[str, str], *, unset: bool = False) -> Notifier:
        address = env.get("NOTIFY_SOCKET")
        usec: int | None = None
        pid = env.get("WATCHDOG_PID")
        if env.get("WATCHDOG_USEC", "").isdigit() and (not pid or pid == str(os.getpid())):
            usec = int(env["WATCHDOG_USEC"])
        if unset:
            for var in NOTIFY_VARS:
                env.pop(var, None)
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to send WATCHDOG=1: half the timeout, as sd_watchdog_enabled(3) recommends."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def notify(self, *lines: str) -> bool:
        if self.address is None:
            return False
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        payload = "\n".join(lines).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(payload, addr)
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self.address, exc)
            return False
        self.sent = [*self.sent[-15:], *lines]
        return True

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def reloading(self, status: str) -> bool:
        usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}", f"STATUS={status}")

    def stopping(self, status: str) -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")

    def extend_timeout(self, seconds: float) -> bool:
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

