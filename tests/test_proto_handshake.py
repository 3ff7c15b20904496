"""HELLO / HELLO_ACK: the transition table, ordering on both sides of the Connection, the exact field sets,
the version check, and the daemon's acceptance rules; fed whole, byte by byte, with trailing bytes, fuzzed."""

from __future__ import annotations

import pytest

from tests.support.proto_connection import ctrl
from tests.support.proto_handshake import ACK, ENGINE, hello, hello_message, receive, rules
from trio_gpuworker._errors import (
    HandshakeError,
    LocalProtocolError,
    UnexpectedFrame,
)
from trio_gpuworker._proto import (
    DAEMON,
    DEFAULT_MAX_FRAME,
    PROTOCOL_VERSION,
    RING_ABI,
    TRANSITIONS,
    WORKER,
    Connection,
    Handshake,
    HandshakeState,
    Hello,
    HelloAck,
    RingReadable,
    encode_frame,
    hello_fields,
)
from trio_gpuworker._proto._handshake import Direction

# --- the whole exchange -------------------------------------------------------------------------


@pytest.mark.parametrize("bytewise", [False, True])
def test_handshake(bytewise: bool) -> None:
    daemon, worker = Connection(DAEMON), Connection(WORKER)
    assert not daemon.handshake_done and not worker.handshake_done
    [got] = receive(daemon, b"".join(worker.send_map("HELLO", hello())), bytewise)
    assert got == hello_message()
    assert not daemon.handshake_done
    ack = rules().check_hello(got)
    assert ack == HelloAck(v=PROTOCOL_VERSION, accept=True, max_frame=DEFAULT_MAX_FRAME, generation=3)
    [got_ack] = receive(worker, b"".join(daemon.send(ack)), bytewise)
    assert got_ack == ack
    assert daemon.handshake_done and worker.handshake_done


def test_hello_fields() -> None:
    fields = hello_fields("ab", 12, 1024, ENGINE, manifest_digest="sha256:x", packed=True)
    assert fields == {"v": 3, "nonce": "ab", "engine": ENGINE, "pid": 12, "max_frame": 1024, "ring_abi": RING_ABI,
                      "manifest_digest": "sha256:x", "packed": True}


def test_hello_with_optional_fields() -> None:
    daemon = Connection(DAEMON)
    fields = hello(kernel_revision="k1", manifest_digest="d", packed=False)
    [got] = receive(daemon, ctrl("HELLO", **fields))
    assert got == Hello(**fields)


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
    daemon.send_map("HELLO_ACK", ACK)
    with pytest.raises(UnexpectedFrame):
        receive(daemon, ctrl("HELLO", **hello()))


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
    worker.send_map("HELLO", hello())
    with pytest.raises(UnexpectedFrame):
        receive(worker, frame)


def test_worker_rejects_a_second_ack() -> None:
    worker = Connection(WORKER)
    worker.send_map("HELLO", hello())
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
        worker.send_map("PONG", {"req_id": 0, "rss_mb": 1.0, "models_loaded": []})
    with pytest.raises(LocalProtocolError):
        worker.send_map("RING_READABLE", {"ring_id": 1})
    worker.send_map("HELLO", hello())


def test_daemon_may_send_only_hello_ack_before_handshake() -> None:
    daemon = Connection(DAEMON)
    receive(daemon, ctrl("HELLO", **hello()))
    with pytest.raises(LocalProtocolError):
        daemon.send_map("PING", {"req_id": 1})
    with pytest.raises(LocalProtocolError):
        daemon.send_map("RING_WRITABLE", {"ring_id": 1})
    daemon.send_map("HELLO_ACK", ACK)
    daemon.send_map("PING", {"req_id": 1})


def test_sending_ack_applies_the_negotiated_max_frame() -> None:
    daemon = Connection(DAEMON)
    receive(daemon, ctrl("HELLO", **hello(max_frame=1 << 20)))
    daemon.send_map("HELLO_ACK", {**ACK, "max_frame": 1 << 20})
    assert daemon.max_frame == 1 << 20
    with pytest.raises(LocalProtocolError):
        daemon.send_map("UNLOAD", {"req_id": 1, "model_ref": "m" * (1 << 20)})


def test_daemon_cannot_ack_before_hello() -> None:
    with pytest.raises(LocalProtocolError):
        Connection(DAEMON).send_map("HELLO_ACK", ACK)


def test_handshake_messages_cannot_be_sent_twice() -> None:
    daemon = Connection(DAEMON)
    receive(daemon, ctrl("HELLO", **hello()))
    daemon.send_map("HELLO_ACK", ACK)
    with pytest.raises(LocalProtocolError):
        daemon.send_map("HELLO_ACK", ACK)
    worker = Connection(WORKER)
    worker.send_map("HELLO", hello())
    with pytest.raises(LocalProtocolError):
        worker.send_map("HELLO", hello())


def test_worker_rejects_ack_before_its_hello() -> None:
    with pytest.raises(UnexpectedFrame):
        receive(Connection(WORKER), ctrl("HELLO_ACK", **ACK))


def test_worker_applies_the_negotiated_max_frame() -> None:
    worker = Connection(WORKER)
    worker.send_map("HELLO", hello())
    receive(worker, ctrl("HELLO_ACK", **{**ACK, "max_frame": 1 << 20}))
    assert worker.max_frame == 1 << 20


def test_worker_rejects_a_refusing_ack() -> None:
    worker = Connection(WORKER)
    worker.send_map("HELLO", hello())
    with pytest.raises(HandshakeError):
        receive(worker, ctrl("HELLO_ACK", **{**ACK, "accept": False}))


# --- the transition table -----------------------------------------------------------------------


def test_the_table_is_the_whole_handshake() -> None:
    """Every state is reachable from a role's start and every path ends in DONE."""
    for role, start in ((WORKER, HandshakeState.SEND_HELLO), (DAEMON, HandshakeState.AWAIT_HELLO)):
        state, path = start, [start]
        while state is not HandshakeState.DONE:
            [state] = [nxt for (r, s, _d, t), nxt in TRANSITIONS.items() if r == role and s is state and t != "*"]
            path.append(state)
        assert len(path) == 3
    assert {s for (_r, s, _d, _t) in TRANSITIONS} | set(TRANSITIONS.values()) == set(HandshakeState)


@pytest.mark.parametrize("role", [DAEMON, WORKER])
@pytest.mark.parametrize("direction", ["send", "receive"])
@pytest.mark.parametrize("t", ["HELLO", "HELLO_ACK", "PING"])
@pytest.mark.parametrize("state", list(HandshakeState))
def test_every_pair_missing_from_the_table_is_a_fault(role: str, direction: str, t: str,
                                                       state: HandshakeState) -> None:
    hs = Handshake(role, DEFAULT_MAX_FRAME)
    hs.state = state
    fields = {"HELLO": {"t": "HELLO", **hello()}, "HELLO_ACK": {"t": "HELLO_ACK", **ACK}, "PING": {"req_id": 1}}[t]
    key = (role, state, Direction(direction), t if t in ("HELLO", "HELLO_ACK") else "*")
    act = hs.send if direction == "send" else hs.receive
    if key in TRANSITIONS:
        act(t, fields)
        assert hs.state is TRANSITIONS[key]
    else:
        with pytest.raises(LocalProtocolError if direction == "send" else UnexpectedFrame):
            act(t, fields)
        assert hs.state is state


# --- a frame right behind HELLO -----------------------------------------------------------------


BEHIND = [ctrl("RING_READABLE", ring_id=1), ctrl("PONG", req_id=0, rss_mb=1.0, models_loaded=[]), b"\x05"]


@pytest.mark.parametrize("behind", BEHIND)
@pytest.mark.parametrize("bytewise", [False, True])
def test_a_frame_right_behind_hello_is_a_fault_not_the_first_request(behind: bytes, bytewise: bool) -> None:
    daemon = Connection(DAEMON)
    got = []
    with pytest.raises(UnexpectedFrame):  # raised by next_event if it is whole, else by answering HELLO
        got = receive(daemon, ctrl("HELLO", **hello()) + behind, bytewise)
        daemon.send_map("HELLO_ACK", ACK)
    assert got in ([], [hello_message()]) or got[0] == hello_message()
    with pytest.raises(UnexpectedFrame):
        daemon.next_event()  # the connection stays dead


def test_a_frame_after_the_ack_is_delivered() -> None:
    daemon = Connection(DAEMON)
    receive(daemon, ctrl("HELLO", **hello()))
    daemon.send_map("HELLO_ACK", ACK)
    assert receive(daemon, ctrl("RING_READABLE", ring_id=1)) == [RingReadable(ring_id=1)]


def test_a_request_right_behind_the_ack_reaches_the_worker() -> None:
    worker = Connection(WORKER)
    worker.send_map("HELLO", hello())
    got = receive(worker, ctrl("HELLO_ACK", **ACK) + ctrl("PING", req_id=1), bytewise=True)
    assert [m.T for m in got] == ["HELLO_ACK", "PING"]
