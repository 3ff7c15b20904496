"""The fake worker itself: a real process on a real AF_UNIX socket, driven by a blocking daemon-side Connection."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakes import FAKE_WORKER, fake_command
from trio_gpuworker._errors import (
    FrameTooLarge,
    MalformedMessage,
    NonceMismatch,
    RemoteProtocolError,
    UnexpectedFrame,
    VersionMismatch,
)
from trio_gpuworker._proto import (
    CLOSED,
    DAEMON,
    DEFAULT_MAX_FRAME,
    NEED_DATA,
    Connection,
    HandshakeRules,
    Hello,
    WireMessage,
    WorkerStopped,
)

TIMEOUT = 10.0


class Daemon:
    """The daemon's end, blocking: listen, spawn the fake, accept, speak protocol v3 through a Connection."""

    def __init__(self, sock_dir: Path, behavior: str | None = None, **opts: Any) -> None:
        self.path = str(sock_dir / f"w{secrets.token_hex(2)}.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(1)
        self.listener.settimeout(TIMEOUT)
        self.nonce = secrets.token_hex(16)
        self.log = sock_dir / f"{Path(self.path).stem}.log"
        with open(self.log, "wb") as log:  # stdout and stderr, for asserting on and for reading after a failure
            self.proc = subprocess.Popen(
                [*fake_command(behavior, **opts), "--socket", self.path, "--nonce", self.nonce],
                stdout=log, stderr=subprocess.STDOUT)
        self.sock: socket.socket | None = None
        self.conn = Connection(DAEMON)

    def accept(self) -> None:
        self.sock, _ = self.listener.accept()
        self.sock.settimeout(TIMEOUT)

    def recv(self) -> WireMessage | object:
        """The next message, or CLOSED."""
        assert self.sock is not None
        while (event := self.conn.next_event()) is NEED_DATA:
            self.conn.receive_data(self.sock.recv(1 << 16))
        return event

    def send(self, t: str, fields: dict[str, Any], raw: bytes | None = None) -> None:
        assert self.sock is not None
        for chunk in self.conn.send_map(t, fields, raw):
            self.sock.sendall(chunk)

    def handshake(self) -> None:
        self.accept()
        hello = self.message()
        assert isinstance(hello, Hello)
        ack = HandshakeRules(self.nonce, self.proc.pid, DEFAULT_MAX_FRAME, generation=1).check_hello(hello)
        for chunk in self.conn.send(ack):
            self.sock.sendall(chunk)

    def message(self) -> WireMessage:
        msg = self.recv()
        assert isinstance(msg, WireMessage), msg
        return msg

    def reply(self) -> list[WireMessage]:
        """PROGRESS frames up to and including the terminal reply."""
        out = [self.message()]
        while out[-1].T == "PROGRESS":
            out.append(self.message())
        return out

    def request(self, t: str, fields: dict[str, Any], raw: bytes | None = None) -> list[WireMessage]:
        self.send(t, fields, raw)
        return self.reply()

    def wait(self) -> int:
        return self.proc.wait(TIMEOUT)

    def close(self) -> None:
        for s in (self.sock, self.listener):
            if s is not None:
                s.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT)


@pytest.fixture
def spawn() -> Iterator[Callable[..., Daemon]]:
    daemons: list[Daemon] = []
    with tempfile.TemporaryDirectory(prefix="fw") as d:  # short: AF_UNIX paths are limited to ~107 bytes

        def start(behavior: str | None = None, **opts: Any) -> Daemon:
            daemons.append(Daemon(Path(d), behavior, **opts))
            return daemons[-1]

        yield start
        for daemon in daemons:
            daemon.close()


def ids(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def f32(raw: bytes | None) -> list[float]:
    assert raw is not None
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


# --- fake_command ---------------------------------------------------------------------------------


def test_fake_command() -> None:
    assert fake_command() == (sys.executable, str(FAKE_WORKER))
    assert fake_command("slow", delay=1.5, progress_every=0.1, on_request=0, once_file=Path("/x/y")) == (
        sys.executable, str(FAKE_WORKER), "--behavior", "slow", "--delay", "1.5", "--progress-every", "0.1",
        "--on-request", "0", "--once-file", "/x/y")
    assert fake_command("garbage", delay=None) == (sys.executable, str(FAKE_WORKER), "--behavior", "garbage")
    with pytest.raises(ValueError):
        fake_command("explode")
    with pytest.raises(TypeError):
        fake_command(socket="/tmp/s")


# --- normal service -------------------------------------------------------------------------------


def test_serves_every_request_then_shuts_down(spawn: Callable[..., Daemon]) -> None:
    d = spawn()
    d.handshake()

    load = {"artifact_path": "/models/fake-embed.bin", "artifact_digest": "sha256:0", "format": "fake",
            "runtime_config": {}}
    progress, loaded = d.request("LOAD", {"req_id": 1, **load})
    assert (progress.T, progress.phase, progress.completed) == ("PROGRESS", "setup", 1)
    assert (loaded.T, loaded.model_ref, loaded.dims) == ("LOADED", "fake-embed.bin", 4)
    [_, loaded] = d.request("LOAD", {"req_id": 2, **load, "model_ref": "m"})
    assert loaded.model_ref == "m"

    items = [{"id": 10, "n_tokens": 3}, {"id": 11, "n_tokens": 2}]
    progress, vectors = d.request("EMBED_BATCH", {"req_id": 3, "model_ref": "m", "pooling": "mean",
                                                  "normalize": True, "items": items}, ids(1, 2, 3, 10, 20))
    assert (progress.T, progress.phase) == ("PROGRESS", "inference")
    assert (vectors.T, vectors.dims, vectors.n) == ("VECTORS", 4, 2)
    assert f32(vectors.raw) == [6, 3, 10, 3, 30, 2, 11, 3]

    _, scores = d.request("RERANK", {"req_id": 4, "model_ref": "m", "query_n_tokens": 2,
                                     "candidates": [{"n_tokens": 1}, {"n_tokens": 2}]}, ids(9, 9, 5, 1, 2))
    assert (scores.T, scores.n, f32(scores.raw)) == ("SCORES", 2, [5.0, 3.0])

    _, text = d.request("GENERATE", {"req_id": 5, "model_ref": "m", "max_tokens": 8}, ids(4, 5))
    assert (text.T, text.text, text.n_prompt, text.n_gen) == ("TEXT", "fake 9", 2, 3)
    _, err = d.request("GENERATE", {"req_id": 6, "model_ref": "m", "max_tokens": 8, "grammar": "root"}, ids(1))
    assert (err.T, err.req_id, err.code) == ("ERR", 6, "grammar_unsupported")

    [pong] = d.request("PING", {"req_id": 7})
    assert (pong.T, pong.models_loaded) == ("PONG", ["fake-embed.bin", "m"]) and pong.rss_mb > 0
    assert d.request("UNLOAD", {"req_id": 8, "model_ref": "m"})[0].T == "UNLOADED"
    assert d.request("PING", {"req_id": 9})[0].models_loaded == ["fake-embed.bin"]

    [stopped] = d.request("SHUTDOWN", {"req_id": 10, "mode": "graceful"})
    assert stopped == WorkerStopped(reason="graceful", req_id=10)
    assert d.recv() is CLOSED
    assert d.wait() == 0


# --- behaviors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("behavior", "error"), [
    ("wrong_nonce", NonceMismatch),
    ("v2_hello", VersionMismatch),
    ("garbage_hello", MalformedMessage),
    ("frame_before_hello", UnexpectedFrame),
    ("frame_behind_hello", UnexpectedFrame),
])
def test_handshake_breakers(spawn: Callable[..., Daemon], behavior: str, error: type[RemoteProtocolError]) -> None:
    d = spawn(behavior)
    with pytest.raises(error):
        d.handshake()


def embed(d: Daemon, req_id: int = 1) -> list[WireMessage]:
    fields = {"req_id": req_id, "model_ref": "m", "pooling": "mean", "normalize": False,
              "items": [{"id": 0, "n_tokens": 2}]}
    return d.request("EMBED_BATCH", fields, ids(1, 2))


def test_oversize_length(spawn: Callable[..., Daemon]) -> None:
    d = spawn("oversize_length")
    d.handshake()
    with pytest.raises(FrameTooLarge):
        embed(d)


def test_crash_mid_request(spawn: Callable[..., Daemon]) -> None:
    d = spawn("crash_mid_request", on_request=2)
    d.handshake()
    assert embed(d, 1)[-1].T == "VECTORS"
    d.send("EMBED_BATCH", {"req_id": 2, "model_ref": "m", "pooling": "mean", "normalize": False, "items": []}, b"")
    assert d.recv() is CLOSED
    assert d.wait() == 5


def test_crash_between_header_and_raw(spawn: Callable[..., Daemon]) -> None:
    d = spawn("crash_between_header_and_raw")
    d.handshake()
    with pytest.raises(UnexpectedFrame):
        embed(d)
    assert d.wait() == 6


def test_once_file_misbehaves_only_in_the_first_generation(spawn: Callable[..., Daemon], tmp_path: Path) -> None:
    once = tmp_path / "once"
    first = spawn("crash_before_hello", once_file=once)
    assert first.wait() == 3 and once.exists()
    second = spawn("crash_before_hello", once_file=once)
    second.handshake()
    assert embed(second)[-1].T == "VECTORS"
    os.kill(second.proc.pid, 15)
    assert second.wait() == -15


def test_crash_during_load(spawn: Callable[..., Daemon]) -> None:
    d = spawn("crash_during_load")
    d.handshake()
    d.send("LOAD", {"req_id": 1, "artifact_path": "/a/m.bin", "artifact_digest": "", "format": "fake",
                    "runtime_config": {}})
    assert d.message().T == "PROGRESS"
    assert d.recv() is CLOSED
    assert d.wait() == 4


def test_reply_faults(spawn: Callable[..., Daemon]) -> None:
    d = spawn("regressing_progress")
    d.handshake()
    first, second, reply = embed(d, 4)
    assert [first.completed, second.completed, reply.req_id] == [2, 1, 4]
    d = spawn("wrong_req_id")
    d.handshake()
    progress, reply = embed(d, 4)
    assert (progress.req_id, reply.T, reply.req_id) == (4, "VECTORS", 5)
    d = spawn("garbage")
    d.handshake()
    with pytest.raises(MalformedMessage):
        embed(d)


def test_slow_with_progress(spawn: Callable[..., Daemon]) -> None:
    d = spawn("slow", delay=0.3, progress_every=0.05)
    d.handshake()
    *progress, reply = embed(d)
    assert len(progress) >= 4 and [p.completed for p in progress] == list(range(1, len(progress) + 1))
    assert reply.T == "VECTORS"


def test_exit_after_reply_and_flood(spawn: Callable[..., Daemon]) -> None:
    d = spawn("exit_after_reply")
    d.handshake()
    assert embed(d)[-1].T == "VECTORS"
    assert d.recv() is CLOSED
    assert d.wait() == 0
    d = spawn("flood_stderr")
    d.handshake()
    assert embed(d)[-1].T == "VECTORS"
    assert d.log.stat().st_size >= 2 << 20


def test_signal_behaviors(spawn: Callable[..., Daemon]) -> None:
    d = spawn("ignore_sigterm")
    d.handshake()
    d.proc.terminate()
    assert embed(d)[-1].T == "VECTORS"  # still serving after SIGTERM
    d.proc.kill()
    assert d.wait() == -signal.SIGKILL
    d = spawn("hang_sigstop")
    d.handshake()
    d.send("PING", {"req_id": 1})  # not a serving request: answered
    assert d.message().T == "PONG"
    d.send("EMBED_BATCH", {"req_id": 2, "model_ref": "m", "pooling": "mean", "normalize": False, "items": []}, b"")
    assert os.waitid(os.P_PID, d.proc.pid, os.WSTOPPED | os.WNOWAIT).si_code == os.CLD_STOPPED
    os.kill(d.proc.pid, signal.SIGCONT)  # resumed, it answers
    assert d.reply()[-1].T == "VECTORS"
