"""A stand-in for systemd's NOTIFY_SOCKET: a datagram socket that records what the daemon's sd_notify sends."""

from __future__ import annotations

import socket
from collections.abc import Callable

import trio

from tests.support.helpers import wait_until


class FakeSystemd:
    """Binds NOTIFY_SOCKET and records every datagram's lines."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.messages: list[list[str]] = []

    async def bind(self) -> None:
        await self.sock.bind("\0" + self.address[1:] if self.address.startswith("@") else self.address)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.bind()
        task_status.started()
        with self.sock:
            while True:
                self.messages.append((await self.sock.recv(65536)).decode().split("\n"))

    def lines(self) -> list[str]:
        return [line for msg in self.messages for line in msg]

    def count(self, line: str) -> int:
        return self.lines().count(line)

    async def wait_for(self, pred: Callable[[], bool]) -> None:
        await wait_until(pred)
