"""Connection: sending, and every valid message round-tripped under any chunking; the decoder fuzzed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.proto_connection import (
    ENGINE,
    Event,
    ctrl,
    daemon_side,
    established,
    events,
    joined,
    msg,
    worker_side,
)
from trio_gpuworker._errors import LocalProtocolError, RemoteProtocolError
from trio_gpuworker._proto import (
    CLOSED,
    DAEMON,
    NEED_DATA,
    SCHEMAS,
    WORKER,
    Connection,
    WireMessage,
    encode_frame,
    hello_fields,
)

# --- sending ------------------------------------------------------------------------------------


def test_send_control_message() -> None:
    daemon, worker = established()
    chunks = daemon.send_map("PING", {"req_id": 9})
    assert len(chunks) == 1
    assert events(worker, joined(chunks)) == [msg("PING", req_id=9)]


def test_send_with_raw_frame() -> None:
    daemon, worker = established()
    raw = bytes(range(12))
    fields = {"req_id": 2, "model_ref": "m", "pooling": "cls", "normalize": False,
              "items": [{"id": 5, "n_tokens": 3}]}
    chunks = daemon.send_map("EMBED_BATCH", fields, raw)
    assert [bytes(c) for c in chunks[1:]] == [b"\x0c\x00\x00\x00", raw]
    assert events(worker, joined(chunks)) == [msg("EMBED_BATCH", raw, **fields)]


def test_send_raw_memoryview_is_not_copied() -> None:
    worker = worker_side()
    raw = memoryview(bytearray(16))
    chunks = worker.send_map("SCORES", {"req_id": 1, "n": 4}, raw)
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
        conn.send_map(t, fields, raw)
    # our own mistake does not kill the connection
    if sender == DAEMON:
        assert events(worker, joined(daemon.send_map("PING", {"req_id": 5}))) == [msg("PING", req_id=5)]
    else:
        assert events(daemon, joined(worker.send_map("UNLOADED", {"req_id": 5}))) == [msg("UNLOADED", req_id=5)]


def test_send_control_frame_over_max_frame() -> None:
    daemon, _ = established(max_frame=64)
    with pytest.raises(LocalProtocolError):
        daemon.send_map("UNLOAD", {"req_id": 1, "model_ref": "m" * 64})


def test_send_fields_cannot_override_the_type() -> None:
    daemon, worker = established()
    try:
        chunks = daemon.send_map("PING", {"req_id": 1, "t": "SHUTDOWN"})
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
                assert event is NEED_DATA or event is CLOSED or isinstance(event, WireMessage)
                if not isinstance(event, WireMessage):
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
    wire = b"".join(joined(sender.send_map(t, fields, raw)) for t, fields, raw in sent)
    cuts = data.draw(st.lists(st.integers(0, len(wire)), max_size=12))
    got: list[Event] = []
    for chunk in split(wire, cuts):
        got += events(receiver, chunk)
    assert got == [msg(t, raw, **fields) for t, fields, raw in sent]
    assert not receiver.mid_frame
    assert events(receiver, b"", eof=True) == [CLOSED]
