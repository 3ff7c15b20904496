"""Connection: CBOR control maps, raw-frame pairing, EOF, direction, sending; fuzzed and round-tripped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import cbor2
import pytest

from tests.support.proto_connection import (
    FEEDS,
    ctrl,
    daemon_side,
    established,
    events,
    joined,
    msg,
    worker_side,
)
from trio_gpuworker._errors import (
    FrameTooLarge,
    LocalProtocolError,
    MalformedMessage,
    UnexpectedFrame,
)
from trio_gpuworker._proto import (
    CLOSED,
    DAEMON,
    DEFAULT_MAX_FRAME,
    NEED_DATA,
    WORKER,
    Connection,
    decode_control,
    encode_frame,
)

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
        pytest.param("EMBED_BATCH", {"req_id": 1, "model_ref": "m", "pooling": "weightedmean", "normalize": True,
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
                 lambda: daemon.receive_data(b""), lambda: daemon.send_map("PING", {"req_id": 2})):
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
        assert events(worker, joined(daemon.send_map(t, {"ring_id": 3}))) == [msg(t, ring_id=3)]
        assert events(daemon, joined(worker.send_map(t, {"ring_id": 4}))) == [msg(t, ring_id=4)]
