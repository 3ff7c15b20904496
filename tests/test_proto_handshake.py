"""HELLO / HELLO_ACK: ordering on both sides of the Connection, and the daemon's acceptance rules."""

from __future__ import annotations

from typing import Any

import cbor2
import pytest

from trio_gpuworker._errors import (
    HandshakeError,
    LocalProtocolError,
    MalformedMessage,
    NonceMismatch,
    PidMismatch,
    RemoteProtocolError,
    RingAbiMismatch,
    UnexpectedFrame,
    VersionMismatch,
)
from trio_gpuworker._proto import (
    DAEMON,
    DEFAULT_MAX_FRAME,
    NEED_DATA,
    PROTOCOL_VERSION,
    RING_ABI,
    WORKER,
    Connection,
    HandshakeRules,
    Message,
    encode_frame,
    hello_fields,
)

ENGINE = {"engine": "fake", "version": "1", "build_flags": "cpu"}
NONCE = "9f" * 16
PID = 4242
ACK = {"v": 3, "accept": True, "max_frame": DEFAULT_MAX_FRAME, "generation": 1}


def ctrl(t: str, **fields: Any) -> bytes:
    return encode_frame(cbor2.dumps({"t": t, **fields}))


def hello(**overrides: Any) -> dict[str, Any]:
    return {**hello_fields(NONCE, PID, DEFAULT_MAX_FRAME, ENGINE), **overrides}


def receive(conn: Connection, data: bytes, bytewise: bool = False) -> list[Message]:
    out: list[Message] = []
    for chunk in [data[i : i + 1] for i in range(len(data))] if bytewise else [data]:
        conn.receive_data(chunk)
        while (event := conn.next_event()) is not NEED_DATA:
            assert isinstance(event, Message)
            out.append(event)
    return out


def rules(**overrides: Any) -> HandshakeRules:
    return HandshakeRules(**{"nonce": NONCE, "pid": PID, "max_frame": DEFAULT_MAX_FRAME, "generation": 3,
                             **overrides})


def hello_message(**overrides: Any) -> Message:
    fields = hello(**overrides)
    return Message("HELLO", {"t": "HELLO", **fields})


# --- the whole exchange -------------------------------------------------------------------------


@pytest.mark.parametrize("bytewise", [False, True])
def test_handshake(bytewise: bool) -> None:
    daemon, worker = Connection(DAEMON), Connection(WORKER)
    assert not daemon.handshake_done and not worker.handshake_done
    [got] = receive(daemon, b"".join(worker.send("HELLO", hello())), bytewise)
    assert got == hello_message()
    assert not daemon.handshake_done
    ack = rules().check_hello(got)
    assert ack == {"v": PROTOCOL_VERSION, "accept": True, "max_frame": DEFAULT_MAX_FRAME, "generation": 3}
    [got_ack] = receive(worker, b"".join(daemon.send("HELLO_ACK", ack)), bytewise)
    assert got_ack == Message("HELLO_ACK", {"t": "HELLO_ACK", **ack})
    assert daemon.handshake_done and worker.handshake_done


def test_hello_fields() -> None:
    fields = hello_fields("ab", 12, 1024, ENGINE, manifest_digest="sha256:x", packed=True)
    assert fields == {"v": 3, "nonce": "ab", "engine": ENGINE, "pid": 12, "max_frame": 1024, "ring_abi": RING_ABI,
                      "manifest_digest": "sha256:x", "packed": True}


def test_hello_with_optional_fields_and_extras() -> None:
    daemon = Connection(DAEMON)
    fields = hello(kernel_revision="k1", manifest_digest="d", packed=False, future_field=[1])
    [got] = receive(daemon, ctrl("HELLO", **fields))
    assert got.fields == {"t": "HELLO", **fields}


# --- ordering, daemon side ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(ctrl("PONG", req_id=0, rss_mb=1.0, models_loaded=[]), id="pong"),
        pytest.param(ctrl("PROGRESS", req_id=0, completed=1, phase="setup"), id="progress"),
        pytest.param(ctrl("RING_READABLE", ring_id=1), id="wake-hint"),
        pytest.param(ctrl("WORKER_FATAL", reason="early"), id="fatal"),
        pytest.param(ctrl("VECTORS", req_id=0, dims=1, n=1, raw_len=4) + encode_frame(bytes(4)), id="raw"),
    ],
)
def test_daemon_rejects_anything_before_hello(frame: bytes) -> None:
    with pytest.raises(UnexpectedFrame):
        receive(Connection(DAEMON), frame)


def test_daemon_rejects_a_second_hello_before_ack() -> None:
    daemon = Connection(DAEMON)
    receive(daemon, ctrl("HELLO", **hello()))
    with pytest.raises(UnexpectedFrame):
        receive(daemon, ctrl("HELLO", **hello()))


def test_daemon_rejects_a_message_between_hello_and_ack() -> None:
    daemon = Connection(DAEMON)
    receive(daemon, ctrl("HELLO", **hello()))
    with pytest.raises(UnexpectedFrame):
        receive(daemon, ctrl("RING_READABLE", ring_id=1))


def test_daemon_rejects_hello_after_handshake() -> None:
    daemon = Connection(DAEMON)
    receive(daemon, ctrl("HELLO", **hello()))
    daemon.send("HELLO_ACK", ACK)
    with pytest.raises(UnexpectedFrame):
        receive(daemon, ctrl("HELLO", **hello()))


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"v": 2}, id="v2-bare"),
        pytest.param({"v": 2, "nonce": NONCE}, id="v2-partial"),
        pytest.param({**hello(), "v": 2}, id="v2-complete"),
        pytest.param({**hello(), "v": 4}, id="v4"),
        pytest.param({**hello(), "v": "3"}, id="v-text"),
        pytest.param({"nonce": NONCE}, id="no-v"),
    ],
)
def test_hello_of_another_version_is_a_version_mismatch(fields: dict[str, Any]) -> None:
    with pytest.raises(VersionMismatch):
        receive(Connection(DAEMON), ctrl("HELLO", **fields))


def test_v3_hello_missing_fields_is_malformed_not_a_version_mismatch() -> None:
    with pytest.raises(MalformedMessage):
        receive(Connection(DAEMON), ctrl("HELLO", v=3, nonce=NONCE))


# --- ordering, worker side ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(ctrl("PING", req_id=1), id="ping"),
        pytest.param(ctrl("RING_WRITABLE", ring_id=1), id="wake-hint"),
        pytest.param(ctrl("SHUTDOWN", req_id=1), id="shutdown"),
    ],
)
def test_worker_rejects_anything_before_ack(frame: bytes) -> None:
    worker = Connection(WORKER)
    worker.send("HELLO", hello())
    with pytest.raises(UnexpectedFrame):
        receive(worker, frame)


def test_worker_rejects_a_second_ack() -> None:
    worker = Connection(WORKER)
    worker.send("HELLO", hello())
    receive(worker, ctrl("HELLO_ACK", **ACK))
    with pytest.raises(UnexpectedFrame):
        receive(worker, ctrl("HELLO_ACK", **ACK))


def test_worker_rejects_hello() -> None:
    with pytest.raises(UnexpectedFrame):
        receive(Connection(WORKER), ctrl("HELLO", **hello()))


# --- ordering, sending --------------------------------------------------------------------------


def test_worker_may_send_only_hello_before_ack() -> None:
    worker = Connection(WORKER)
    with pytest.raises(LocalProtocolError):
        worker.send("PONG", {"req_id": 0, "rss_mb": 1.0, "models_loaded": []})
    with pytest.raises(LocalProtocolError):
        worker.send("RING_READABLE", {"ring_id": 1})
    worker.send("HELLO", hello())


def test_daemon_may_send_only_hello_ack_before_handshake() -> None:
    daemon = Connection(DAEMON)
    receive(daemon, ctrl("HELLO", **hello()))
    with pytest.raises(LocalProtocolError):
        daemon.send("PING", {"req_id": 1})
    with pytest.raises(LocalProtocolError):
        daemon.send("RING_WRITABLE", {"ring_id": 1})
    daemon.send("HELLO_ACK", ACK)
    daemon.send("PING", {"req_id": 1})


def test_sending_ack_applies_the_negotiated_max_frame() -> None:
    daemon = Connection(DAEMON)
    receive(daemon, ctrl("HELLO", **hello(max_frame=1 << 20)))
    daemon.send("HELLO_ACK", {**ACK, "max_frame": 1 << 20})
    assert daemon.max_frame == 1 << 20
    with pytest.raises(LocalProtocolError):
        daemon.send("UNLOAD", {"req_id": 1, "model_ref": "m" * (1 << 20)})


def test_daemon_cannot_ack_before_hello() -> None:
    with pytest.raises(LocalProtocolError):
        Connection(DAEMON).send("HELLO_ACK", ACK)


def test_handshake_messages_cannot_be_sent_twice() -> None:
    daemon = Connection(DAEMON)
    receive(daemon, ctrl("HELLO", **hello()))
    daemon.send("HELLO_ACK", ACK)
    with pytest.raises(LocalProtocolError):
        daemon.send("HELLO_ACK", ACK)
    worker = Connection(WORKER)
    worker.send("HELLO", hello())
    with pytest.raises(LocalProtocolError):
        worker.send("HELLO", hello())


def test_worker_rejects_ack_before_its_hello() -> None:
    with pytest.raises(UnexpectedFrame):
        receive(Connection(WORKER), ctrl("HELLO_ACK", **ACK))


def test_worker_applies_the_negotiated_max_frame() -> None:
    worker = Connection(WORKER)
    worker.send("HELLO", hello())
    receive(worker, ctrl("HELLO_ACK", **{**ACK, "max_frame": 1 << 20}))
    assert worker.max_frame == 1 << 20


def test_worker_rejects_a_refusing_ack() -> None:
    worker = Connection(WORKER)
    worker.send("HELLO", hello())
    with pytest.raises(HandshakeError):
        receive(worker, ctrl("HELLO_ACK", **{**ACK, "accept": False}))


# --- HandshakeRules -----------------------------------------------------------------------------


def test_rules_accept() -> None:
    assert rules(generation=7).check_hello(hello_message()) == {"v": 3, "accept": True,
                                                                 "max_frame": DEFAULT_MAX_FRAME, "generation": 7}


@pytest.mark.parametrize(("ours", "theirs"), [(1 << 20, DEFAULT_MAX_FRAME), (DEFAULT_MAX_FRAME, 1 << 20),
                                              (4096, 4096)])
def test_rules_negotiate_the_smaller_max_frame(ours: int, theirs: int) -> None:
    ack = rules(max_frame=ours).check_hello(hello_message(max_frame=theirs))
    assert ack["max_frame"] == min(ours, theirs)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"v": 2}, VersionMismatch),
        ({"nonce": "00" * 16}, NonceMismatch),
        ({"nonce": NONCE.upper()}, NonceMismatch),
        ({"pid": PID + 1}, PidMismatch),
        ({"ring_abi": RING_ABI + 1}, RingAbiMismatch),
        ({"ring_abi": 1}, RingAbiMismatch),
        # version is checked first, then nonce, then pid, then ring ABI
        ({"v": 2, "nonce": "x", "pid": 1, "ring_abi": 9}, VersionMismatch),
        ({"nonce": "x", "pid": 1, "ring_abi": 9}, NonceMismatch),
        ({"pid": 1, "ring_abi": 9}, PidMismatch),
    ],
)
def test_rules_reject(overrides: dict[str, Any], error: type[HandshakeError]) -> None:
    with pytest.raises(error):
        rules().check_hello(hello_message(**overrides))


def test_rules_other_supported_ring_abis() -> None:
    assert rules(ring_abis=frozenset({1, 2})).check_hello(hello_message(ring_abi=1))["accept"] is True


def test_handshake_errors_are_remote_protocol_errors_with_codes() -> None:
    for error, code in [(VersionMismatch, "version_mismatch"), (NonceMismatch, "nonce_mismatch"),
                        (PidMismatch, "pid_mismatch"), (RingAbiMismatch, "ring_helper_abi_mismatch")]:
        assert issubclass(error, HandshakeError) and issubclass(error, RemoteProtocolError)
        assert error.code == code
