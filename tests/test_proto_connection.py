"""Connection: CBOR control maps, raw-frame pairing, EOF, direction, sending; fuzzed and round-tripped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_gpuworker._errors import (
    FrameTooLarge,
    LocalProtocolError,
    MalformedMessage,
    RemoteProtocolError,
    UnexpectedFrame,
)
from trio_gpuworker._proto import (
    CLOSED,
    DAEMON,
    DEFAULT_MAX_FRAME,
    NEED_DATA,
    SCHEMAS,
    WORKER,
    Connection,
    Message,
    decode_control,
    encode_frame,
    hello_fields,
)

ENGINE = {"engine": "fake", "version": "1", "build_flags": []}
Event = Any  # Message | NEED_DATA | CLOSED


# --- helpers ------------------------------------------------------------------------------------


def ctrl(t: str, **fields: Any) -> bytes:
    """A control frame built by hand, so the receiving side can be shown anything."""
    return encode_frame(cbor2.dumps({"t": t, **fields}))


def msg(t: str, raw: bytes | None = None, **fields: Any) -> Message:
    """The Message the receiver should produce."""
    if raw is not None:
        fields["raw_len"] = len(raw)
    return Message(t, {"t": t, **fields}, raw)


def whole(data: bytes) -> Iterator[bytes]:
    if data:
        yield data


def bytewise(data: bytes) -> Iterator[bytes]:
    for i in range(len(data)):
        yield data[i : i + 1]


FEEDS = [whole, bytewise]


def events(conn: Connection, data: bytes, feed: Callable[[bytes], Iterator[bytes]] = whole,
           eof: bool = False) -> list[Event]:
    """Feed `data` chunk by chunk (then EOF if asked); every event up to NEED_DATA or CLOSED."""
    out: list[Event] = []

    def drain() -> None:
        while (event := conn.next_event()) is not NEED_DATA:
            out.append(event)
            if event is CLOSED:
                return

    for chunk in feed(data):
        conn.receive_data(chunk)
        drain()
    if eof:
        conn.receive_data(b"")
        drain()
    return out


def joined(chunks: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(c) for c in chunks)


def established(max_frame: int = DEFAULT_MAX_FRAME) -> tuple[Connection, Connection]:
    """A daemon and a worker connection that have completed the handshake with each other."""
    daemon, worker = Connection(DAEMON), Connection(WORKER)
    [hello] = events(daemon, joined(worker.send("HELLO", hello_fields("n0", 7, max_frame, ENGINE))))
    assert hello.t == "HELLO"
    ack = {"v": 3, "accept": True, "max_frame": max_frame, "generation": 1}
    assert events(worker, joined(daemon.send("HELLO_ACK", ack))) == [msg("HELLO_ACK", **ack)]
    assert daemon.handshake_done and worker.handshake_done
    return daemon, worker


def daemon_side() -> Connection:
    return established()[0]


def worker_side() -> Connection:
    return established()[1]


# --- decode_control -----------------------------------------------------------------------------


def test_decode_control_ok() -> None:
    assert decode_control(cbor2.dumps({"t": "PING", "req_id": 1})) == {"t": "PING", "req_id": 1}


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\xff", id="break"),
        pytest.param(b"\xa2\x61t", id="truncated-map"),
        pytest.param(b"{\"t\": \"PING\"}", id="json"),
        pytest.param(cbor2.dumps(["PING", 1]), id="array"),
        pytest.param(cbor2.dumps(5), id="int"),
        pytest.param(cbor2.dumps("PING"), id="string"),
        pytest.param(cbor2.dumps({"t": "PING", 1: 2}), id="int-key"),
        pytest.param(cbor2.dumps({"t": "PING", b"k": 2}), id="bytes-key"),
        pytest.param(cbor2.dumps({"req_id": 1}), id="no-t"),
        pytest.param(cbor2.dumps({"t": 1}), id="t-not-text"),
        pytest.param(cbor2.dumps({"t": b"PING"}), id="t-bytes"),
        pytest.param(cbor2.dumps({"t": "PING", "req_id": 1}) + b"\x00", id="trailing-byte"),
        pytest.param(cbor2.dumps({"t": "PING"}) + cbor2.dumps({"t": "PING"}), id="two-maps"),
    ],
)
def test_decode_control_malformed(payload: bytes) -> None:
    with pytest.raises(MalformedMessage):
        decode_control(payload)


# --- receiving control messages -----------------------------------------------------------------


@pytest.mark.parametrize("feed", FEEDS)
def test_receive_one_message(feed: Callable[[bytes], Iterator[bytes]]) -> None:
    daemon = daemon_side()
    fields = {"req_id": 3, "rss_mb": 12.5, "models_loaded": ["a", "b"]}
    assert events(daemon, ctrl("PONG", **fields), feed) == [msg("PONG", **fields)]
    assert not daemon.mid_frame


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize("trailing", [b"\x09", encode_frame(b"\xa1\x61t")[:6], b"\x00\x00\x00"])
def test_trailing_bytes_wait_for_more(feed: Callable[[bytes], Iterator[bytes]], trailing: bytes) -> None:
    daemon = daemon_side()
    assert events(daemon, ctrl("UNLOADED", req_id=1) + trailing, feed) == [msg("UNLOADED", req_id=1)]
    assert daemon.mid_frame
    assert daemon.next_event() is NEED_DATA


def test_trailing_garbage_frame_faults_after_the_good_message() -> None:
    daemon = daemon_side()
    daemon.receive_data(ctrl("UNLOADED", req_id=1) + encode_frame(b"\xde\xad"))
    assert daemon.next_event() == msg("UNLOADED", req_id=1)
    with pytest.raises(MalformedMessage):
        daemon.next_event()


@pytest.mark.parametrize("feed", FEEDS)
def test_several_messages_in_one_feed(feed: Callable[[bytes], Iterator[bytes]]) -> None:
    daemon = daemon_side()
    data = (ctrl("PROGRESS", req_id=1, completed=1, phase="setup")
            + ctrl("RING_READABLE", ring_id=4)
            + ctrl("LOADED", req_id=1, model_ref="m", dims=4, cold_load_ms=1.5))
    assert events(daemon, data, feed) == [
        msg("PROGRESS", req_id=1, completed=1, phase="setup"),
        msg("RING_READABLE", ring_id=4),
        msg("LOADED", req_id=1, model_ref="m", dims=4, cold_load_ms=1.5),
    ]


def test_extra_fields_are_kept() -> None:
    daemon = daemon_side()
    assert events(daemon, ctrl("UNLOADED", req_id=1, later="x")) == [msg("UNLOADED", req_id=1, later="x")]


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize(
    ("t", "fields"),
    [
        pytest.param("NOPE", {"req_id": 1}, id="unknown-type"),
        pytest.param("PONG", {"req_id": 1, "models_loaded": []}, id="missing-field"),
        pytest.param("PROGRESS", {"req_id": 1, "completed": True, "phase": "setup"}, id="bool-for-uint"),
        pytest.param("PROGRESS", {"req_id": 1, "completed": -1, "phase": "setup"}, id="negative-uint"),
        pytest.param("PROGRESS", {"req_id": 1, "completed": 1 << 64, "phase": "setup"}, id="uint-over-u64"),
        pytest.param("PROGRESS", {"req_id": 1, "completed": 1.0, "phase": "setup"}, id="float-for-uint"),
        pytest.param("PROGRESS", {"req_id": "1", "completed": 1, "phase": "setup"}, id="text-for-uint"),
        pytest.param("PROGRESS", {"req_id": 1, "completed": 1, "phase": "warmup"}, id="bad-choice"),
        pytest.param("LOADED", {"req_id": 1, "model_ref": "m", "dims": 4, "cold_load_ms": False}, id="bool-number"),
        pytest.param("PONG", {"req_id": 1, "rss_mb": 1, "models_loaded": ["a", 2]}, id="bad-list-item"),
        pytest.param("PONG", {"req_id": 1, "rss_mb": 1, "models_loaded": "a"}, id="text-for-list"),
        pytest.param("PONG", {"req_id": 1, "rss_mb": 1, "models_loaded": [], "placement_share": "x"},
                     id="bad-optional"),
        pytest.param("ERR", {"req_id": 1, "code": None, "msg": "m"}, id="null-for-text"),
        pytest.param("VECTORS", {"req_id": 1, "dims": 4, "n": 1}, id="raw-without-raw_len"),
        pytest.param("VECTORS", {"req_id": 1, "dims": 4, "n": 1, "raw_len": True}, id="bool-raw_len"),
        pytest.param("VECTORS", {"req_id": 1, "dims": 4, "n": 1, "raw_len": -16}, id="negative-raw_len"),
        pytest.param("WORKER_STOPPED", {"reason": "bored"}, id="bad-reason"),
    ],
)
def test_malformed_message(feed: Callable[[bytes], Iterator[bytes]], t: str, fields: dict[str, Any]) -> None:
    daemon = daemon_side()
    with pytest.raises(MalformedMessage):
        events(daemon, ctrl(t, **fields), feed)


@pytest.mark.parametrize(
    ("t", "fields"),
    [
        pytest.param("LOAD", {"req_id": 1, "artifact_path": "/a", "artifact_digest": "d", "format": "f",
                              "runtime_config": {1: "x"}}, id="map-with-int-key"),
        pytest.param("EMBED_BATCH", {"req_id": 1, "model_ref": "m", "pooling": "mean", "normalize": True,
                                     "items": [{"id": 1, "n_tokens": False}], "raw_len": 4}, id="record-bool"),
        pytest.param("EMBED_BATCH", {"req_id": 1, "model_ref": "m", "pooling": "mean", "normalize": True,
                                     "items": [{"id": 1}], "raw_len": 4}, id="record-missing-field"),
        pytest.param("EMBED_BATCH", {"req_id": 1, "model_ref": "m", "pooling": "max", "normalize": True,
                                     "items": [], "raw_len": 0}, id="bad-pooling"),
        pytest.param("EMBED_BATCH", {"req_id": 1, "model_ref": "m", "pooling": "mean", "normalize": 1,
                                     "items": [], "raw_len": 0}, id="int-for-bool"),
        pytest.param("GENERATE", {"req_id": 1, "model_ref": "m", "max_tokens": 8, "grammar": 5, "raw_len": 0},
                     id="bad-optional-grammar"),
    ],
)
def test_malformed_request_at_the_worker(t: str, fields: dict[str, Any]) -> None:
    worker = worker_side()
    with pytest.raises(MalformedMessage):
        events(worker, ctrl(t, **fields))


def test_optional_none_and_text_grammar_are_fine() -> None:
    worker = worker_side()
    base = {"req_id": 1, "model_ref": "m", "max_tokens": 8}
    data = (ctrl("GENERATE", **base, grammar=None, raw_len=0) + encode_frame(b"")
            + ctrl("GENERATE", **base, grammar="root ::= x", raw_len=0) + encode_frame(b""))
    assert events(worker, data) == [msg("GENERATE", b"", **base, grammar=None),
                                    msg("GENERATE", b"", **base, grammar="root ::= x")]


def test_after_a_fault_every_call_fails_with_the_same_error() -> None:
    daemon = daemon_side()
    daemon.receive_data(encode_frame(b"\xff"))
    with pytest.raises(MalformedMessage) as first:
        daemon.next_event()
    for call in (daemon.next_event, lambda: daemon.receive_data(ctrl("UNLOADED", req_id=1)),
                 lambda: daemon.receive_data(b""), lambda: daemon.send("PING", {"req_id": 2})):
        with pytest.raises(MalformedMessage) as again:
            call()
        assert again.value is first.value


# --- raw frames ---------------------------------------------------------------------------------


def vectors(raw: bytes, **overrides: Any) -> bytes:
    fields = {"req_id": 1, "dims": 2, "n": 1, "raw_len": len(raw), **overrides}
    return ctrl("VECTORS", **fields) + encode_frame(raw)


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize("raw", [b"", b"\x00\x00\x80\x3f\x00\x00\x00\x40", bytes(1000)])
def test_raw_frame_pairs_with_its_header(feed: Callable[[bytes], Iterator[bytes]], raw: bytes) -> None:
    daemon = daemon_side()
    assert events(daemon, vectors(raw), feed) == [msg("VECTORS", raw, req_id=1, dims=2, n=1)]
    assert not daemon.mid_frame


def test_header_alone_is_not_an_event() -> None:
    daemon = daemon_side()
    data = vectors(b"12345678")
    header_len = len(data) - 12
    assert events(daemon, data[:header_len]) == []
    assert daemon.mid_frame
    assert events(daemon, data[header_len:]) == [msg("VECTORS", b"12345678", req_id=1, dims=2, n=1)]


@pytest.mark.parametrize("feed", FEEDS)
def test_raw_frame_with_trailing_bytes(feed: Callable[[bytes], Iterator[bytes]]) -> None:
    daemon = daemon_side()
    got = events(daemon, vectors(b"abcd") + ctrl("UNLOADED", req_id=2)[:6], feed)
    assert got == [msg("VECTORS", b"abcd", req_id=1, dims=2, n=1)]
    assert events(daemon, ctrl("UNLOADED", req_id=2)[6:]) == [msg("UNLOADED", req_id=2)]


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize("actual", [0, 7, 9, 64])
def test_raw_frame_of_the_wrong_length(feed: Callable[[bytes], Iterator[bytes]], actual: int) -> None:
    daemon = daemon_side()
    data = ctrl("VECTORS", req_id=1, dims=2, n=1, raw_len=8) + encode_frame(bytes(actual))
    with pytest.raises(UnexpectedFrame):
        events(daemon, data, feed)


def test_control_frame_where_the_raw_frame_belongs() -> None:
    daemon = daemon_side()
    data = ctrl("VECTORS", req_id=1, dims=2, n=1, raw_len=8) + ctrl("PROGRESS", req_id=1, completed=1,
                                                                     phase="inference")
    with pytest.raises(UnexpectedFrame):
        events(daemon, data)


def test_raw_len_above_max_frame_is_rejected_before_the_raw_frame() -> None:
    daemon, _ = established(max_frame=64)
    with pytest.raises(FrameTooLarge):
        events(daemon, ctrl("VECTORS", req_id=1, dims=2, n=1, raw_len=65))


def test_raw_frame_prefix_above_max_frame() -> None:
    daemon, _ = established(max_frame=64)
    with pytest.raises(FrameTooLarge):
        events(daemon, ctrl("VECTORS", req_id=1, dims=2, n=1, raw_len=64) + encode_frame(bytes(65))[:4])


def test_oversize_control_length_from_the_prefix_alone() -> None:
    daemon = daemon_side()
    with pytest.raises(FrameTooLarge):
        events(daemon, (DEFAULT_MAX_FRAME + 1).to_bytes(4, "little"))
    worker = Connection(WORKER, max_frame=100)
    with pytest.raises(FrameTooLarge):
        events(worker, (0xFFFFFFF0).to_bytes(4, "little"))


# --- EOF ----------------------------------------------------------------------------------------


def test_clean_eof() -> None:
    daemon = daemon_side()
    assert events(daemon, ctrl("UNLOADED", req_id=1), eof=True) == [msg("UNLOADED", req_id=1), CLOSED]
    assert daemon.next_event() is CLOSED
    with pytest.raises(LocalProtocolError):
        daemon.receive_data(b"late")
    assert daemon.next_event() is CLOSED


def test_eof_before_anything() -> None:
    assert events(Connection(DAEMON), b"", eof=True) == [CLOSED]


@pytest.mark.parametrize("cut", [1, 3, 4, 6])
def test_eof_mid_frame(cut: int) -> None:
    daemon = daemon_side()
    with pytest.raises(UnexpectedFrame):
        events(daemon, ctrl("UNLOADED", req_id=1)[:cut], eof=True)


@pytest.mark.parametrize("cut", [0, 2, 4, 6])
def test_eof_between_header_and_raw_frame(cut: int) -> None:
    daemon = daemon_side()
    header = ctrl("VECTORS", req_id=1, dims=2, n=1, raw_len=8)
    with pytest.raises(UnexpectedFrame):
        events(daemon, header + encode_frame(bytes(8))[:cut], eof=True)


# --- direction ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [ctrl("PONG", req_id=1, rss_mb=1.0, models_loaded=[]), ctrl("UNLOADED", req_id=1),
     ctrl("WORKER_FATAL", reason="x")],
)
def test_worker_only_message_at_the_worker(frame: bytes) -> None:
    worker = worker_side()
    with pytest.raises(UnexpectedFrame):
        events(worker, frame)


@pytest.mark.parametrize("frame", [ctrl("PING", req_id=1), ctrl("UNLOAD", req_id=1, model_ref="m"),
                                   ctrl("SHUTDOWN", req_id=1)])
def test_daemon_only_message_at_the_daemon(frame: bytes) -> None:
    daemon = daemon_side()
    with pytest.raises(UnexpectedFrame):
        events(daemon, frame)


def test_wake_hints_travel_both_ways() -> None:
    daemon, worker = established()
    for t in ("RING_READABLE", "RING_WRITABLE"):
        assert events(worker, joined(daemon.send(t, {"ring_id": 3}))) == [msg(t, ring_id=3)]
        assert events(daemon, joined(worker.send(t, {"ring_id": 4}))) == [msg(t, ring_id=4)]


# --- sending ------------------------------------------------------------------------------------


def test_send_control_message() -> None:
    daemon, worker = established()
    chunks = daemon.send("PING", {"req_id": 9})
    assert len(chunks) == 1
    assert events(worker, joined(chunks)) == [msg("PING", req_id=9)]


def test_send_with_raw_frame() -> None:
    daemon, worker = established()
    raw = bytes(range(12))
    fields = {"req_id": 2, "model_ref": "m", "pooling": "cls", "normalize": False,
              "items": [{"id": 5, "n_tokens": 3}]}
    chunks = daemon.send("EMBED_BATCH", fields, raw)
    assert [bytes(c) for c in chunks[1:]] == [b"\x0c\x00\x00\x00", raw]
    assert events(worker, joined(chunks)) == [msg("EMBED_BATCH", raw, **fields)]


def test_send_raw_memoryview_is_not_copied() -> None:
    worker = worker_side()
    raw = memoryview(bytearray(16))
    chunks = worker.send("SCORES", {"req_id": 1, "n": 4}, raw)
    assert chunks[2] is raw


@pytest.mark.parametrize(
    ("sender", "t", "fields", "raw"),
    [
        pytest.param(DAEMON, "NOPE", {"req_id": 1}, None, id="unknown-type"),
        pytest.param(DAEMON, "PONG", {"req_id": 1, "rss_mb": 1, "models_loaded": []}, None, id="daemon-sends-pong"),
        pytest.param(WORKER, "PING", {"req_id": 1}, None, id="worker-sends-ping"),
        pytest.param(WORKER, "HELLO_ACK", {"v": 3, "accept": True, "max_frame": 1, "generation": 1}, None,
                     id="worker-sends-ack"),
        pytest.param(DAEMON, "HELLO", hello_fields("n", 1, 1, ENGINE), None, id="daemon-sends-hello"),
        pytest.param(DAEMON, "PING", {}, None, id="missing-field"),
        pytest.param(DAEMON, "PING", {"req_id": -1}, None, id="negative-uint"),
        pytest.param(DAEMON, "PING", {"req_id": True}, None, id="bool-for-uint"),
        pytest.param(WORKER, "PROGRESS", {"req_id": 1, "completed": 1, "phase": "later"}, None, id="bad-phase"),
        pytest.param(DAEMON, "UNLOAD", {"req_id": 1, "model_ref": "m"}, b"x", id="raw-on-non-raw"),
        pytest.param(WORKER, "VECTORS", {"req_id": 1, "dims": 2, "n": 1}, None, id="raw-missing"),
        pytest.param(WORKER, "VECTORS", {"req_id": 1, "dims": 2, "n": 1}, bytes(65), id="raw-over-max_frame"),
    ],
)
def test_send_invalid_is_a_local_error(sender: str, t: str, fields: dict[str, Any], raw: bytes | None) -> None:
    daemon, worker = established(max_frame=64)
    worker.set_max_frame(64)
    conn = daemon if sender == DAEMON else worker
    with pytest.raises(LocalProtocolError):
        conn.send(t, fields, raw)
    # our own mistake does not kill the connection
    if sender == DAEMON:
        assert events(worker, joined(daemon.send("PING", {"req_id": 5}))) == [msg("PING", req_id=5)]
    else:
        assert events(daemon, joined(worker.send("UNLOADED", {"req_id": 5}))) == [msg("UNLOADED", req_id=5)]


def test_send_control_frame_over_max_frame() -> None:
    daemon, _ = established(max_frame=64)
    with pytest.raises(LocalProtocolError):
        daemon.send("UNLOAD", {"req_id": 1, "model_ref": "m" * 64})


def test_send_fields_cannot_override_the_type() -> None:
    daemon, worker = established()
    try:
        chunks = daemon.send("PING", {"req_id": 1, "t": "SHUTDOWN"})
    except LocalProtocolError:
        return
    assert events(worker, joined(chunks)) == [msg("PING", req_id=1)]


# --- valid messages, for the round trip and the fuzz -------------------------------------------

u64 = st.integers(0, (1 << 64) - 1)
small = st.integers(0, 1000)
texts = st.text(max_size=12)
numbers = st.integers(0, 1 << 40) | st.floats(allow_nan=False, allow_infinity=False)
raws = st.binary(max_size=48)


def message(t: str, raw: bool = False, optional: dict[str, Any] | None = None, **required: Any) -> Any:
    fields = st.fixed_dictionaries(required, optional=optional or {})
    if raw:
        return st.tuples(st.just(t), fields, raws)
    return st.tuples(st.just(t), fields, st.none())


DAEMON_MESSAGES = st.one_of(
    message("LOAD", req_id=u64, artifact_path=texts, artifact_digest=texts, format=texts,
            runtime_config=st.dictionaries(texts, small | texts, max_size=3), optional={"model_ref": texts}),
    message("EMBED_BATCH", True, req_id=u64, model_ref=texts, pooling=st.sampled_from(["mean", "cls"]),
            normalize=st.booleans(), items=st.lists(st.fixed_dictionaries({"id": u64, "n_tokens": small}),
                                                    max_size=4)),
    message("RERANK", True, req_id=u64, model_ref=texts, query_n_tokens=small,
            candidates=st.lists(st.fixed_dictionaries({"n_tokens": small}), max_size=4)),
    message("GENERATE", True, req_id=u64, model_ref=texts, max_tokens=st.integers(0, 64),
            optional={"grammar": st.none() | texts}),
    message("UNLOAD", req_id=u64, model_ref=texts),
    message("PING", req_id=u64),
    message("SHUTDOWN", req_id=u64, optional={"mode": st.sampled_from(["graceful", "abort_in_flight"])}),
    message("RING_READABLE", ring_id=u64),
    message("RING_WRITABLE", ring_id=u64),
)
WORKER_MESSAGES = st.one_of(
    message("LOADED", req_id=u64, model_ref=texts, dims=small, cold_load_ms=numbers),
    message("VECTORS", True, req_id=u64, dims=small, n=small),
    message("SCORES", True, req_id=u64, n=small, optional={"method": texts}),
    message("TEXT", True, req_id=u64, text=texts, n_prompt=small, n_gen=small,
            finish_reason=st.sampled_from(["stop", "length"])),
    message("UNLOADED", req_id=u64),
    message("PONG", req_id=u64, rss_mb=numbers, models_loaded=st.lists(texts, max_size=3),
            optional={"placement_share": numbers}),
    message("WORKER_STOPPED", reason=st.sampled_from(["graceful", "abort_in_flight", "fatal"]),
            optional={"req_id": u64}),
    message("ERR", req_id=u64, code=texts, msg=texts),
    message("PROGRESS", req_id=u64, completed=u64, phase=st.sampled_from(["setup", "inference", "control"])),
    message("WORKER_FATAL", reason=texts, optional={"msg": texts}),
    message("RING_READABLE", ring_id=u64),
)


# --- fuzz ---------------------------------------------------------------------------------------


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts if 0 < c})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if b > a]


CONNECTIONS: dict[str, Callable[[], Connection]] = {
    "daemon-new": lambda: Connection(DAEMON, max_frame=256),
    "worker-new": lambda: Connection(WORKER, max_frame=256),
    "daemon-established": daemon_side,
    "worker-established": worker_side,
}


def run_fuzz(conn: Connection, data: bytes, cuts: list[int], eof: bool) -> None:
    try:
        for chunk in [*split(data, cuts), *([b""] if eof else [])]:
            conn.receive_data(chunk)
            while True:
                event = conn.next_event()
                assert event is NEED_DATA or event is CLOSED or isinstance(event, Message)
                if not isinstance(event, Message):
                    break
    except RemoteProtocolError as exc:
        with pytest.raises(RemoteProtocolError) as again:
            conn.next_event()
        assert again.value is exc  # the connection stays dead with the same error


@settings(max_examples=200, deadline=None)
@given(side=st.sampled_from(sorted(CONNECTIONS)), data=st.binary(max_size=300),
       cuts=st.lists(st.integers(0, 300), max_size=10), eof=st.booleans())
def test_fuzz_arbitrary_bytes(side: str, data: bytes, cuts: list[int], eof: bool) -> None:
    run_fuzz(CONNECTIONS[side](), data, cuts, eof)


# CBOR values of every kind a peer could send, for frames that decode but should not validate.
cbor_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8) | st.sampled_from(["setup", "inference", "control", "mean", "cls", "graceful", "stop"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6) | st.integers(0, 3), inner,
                                                                 max_size=3),
    max_leaves=5,
)
field_names = st.sampled_from(sorted({f for spec in SCHEMAS.values() for f in (*spec.required, *spec.optional)}
                                     | {"raw_len"}))


def wire(t: str, fields: dict[str, Any], raw: bytes | None, mutation: tuple[str, Any] | None = None) -> bytes:
    """A message framed by hand, whichever side sends it; optionally with one field replaced."""
    fields = {**fields, **({"raw_len": len(raw)} if raw is not None else {}), **dict([mutation] if mutation else [])}
    return ctrl(t, **fields) + (encode_frame(raw) if raw is not None else b"")


valid = st.one_of(DAEMON_MESSAGES, WORKER_MESSAGES, st.just(("HELLO", hello_fields("n0", 7, 1024, ENGINE), None)),
                  st.just(("HELLO_ACK", {"v": 3, "accept": True, "max_frame": 1024, "generation": 1}, None)))
fuzz_frames = st.one_of(
    st.builds(lambda m: wire(*m), valid),
    st.builds(lambda m, f, v: wire(*m, (f, v)), valid, field_names, cbor_values),
    st.builds(lambda m, n: wire(*m)[:n], valid, st.integers(0, 60)),
    st.builds(lambda t, f: encode_frame(cbor2.dumps({"t": t, **f})), st.sampled_from(sorted(SCHEMAS)),
              st.dictionaries(field_names, cbor_values, max_size=6)),
    st.builds(lambda t, f: encode_frame(cbor2.dumps({**f, "t": t})), st.sampled_from(sorted(SCHEMAS)),
              st.dictionaries(field_names, st.integers(0, 300), max_size=8)),
    st.binary(max_size=40).map(encode_frame),
    st.binary(max_size=8),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(side=st.sampled_from(sorted(CONNECTIONS)), frames=st.lists(fuzz_frames, max_size=5),
       cuts=st.lists(st.integers(0, 400), max_size=10), eof=st.booleans())
def test_fuzz_structured_frames(side: str, frames: list[bytes], cuts: list[int], eof: bool) -> None:
    run_fuzz(CONNECTIONS[side](), b"".join(frames), cuts, eof)



@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), from_daemon=st.booleans())
def test_round_trip_under_any_chunking(data: st.DataObject, from_daemon: bool) -> None:
    daemon, worker = established()
    sender, receiver = (daemon, worker) if from_daemon else (worker, daemon)
    sent = data.draw(st.lists(DAEMON_MESSAGES if from_daemon else WORKER_MESSAGES, max_size=8))
    wire = b"".join(joined(sender.send(t, fields, raw)) for t, fields, raw in sent)
    cuts = data.draw(st.lists(st.integers(0, len(wire)), max_size=12))
    got: list[Event] = []
    for chunk in split(wire, cuts):
        got += events(receiver, chunk)
    assert got == [msg(t, raw, **fields) for t, fields, raw in sent]
    assert not receiver.mid_frame
    assert events(receiver, b"", eof=True) == [CLOSED]
