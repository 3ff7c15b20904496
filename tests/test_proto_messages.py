"""The message classes: the tables derived from them equal the hand-written ones they replaced, every class
round-trips through a Connection (fed whole, byte by byte and with trailing bytes) in the bytes the untyped path
writes, and the worker dispatches by class."""

from __future__ import annotations

import dataclasses
from typing import Any

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tests.proto_frozen_schemas as frozen
from tests.proto_frozen_probes import ENGINE, HANDLE, PROBES, STEP_INPUT, STEP_OUTPUT
from tests.support.proto_connection import FEEDS, established, events, joined
from trio_gpuworker import _proto as p
from trio_gpuworker._errors import LocalProtocolError, MalformedMessage
from trio_gpuworker._proto import (
    BOTH,
    DAEMON,
    INTERMEDIATE,
    MESSAGES,
    NEED_DATA,
    REQUESTS,
    SCHEMAS,
    TERMINAL,
    WORKER,
    Connection,
    WireMessage,
    encode_frame,
)

# one valid instance of every class, optional fields set where there are any
SAMPLES: list[WireMessage] = [
    p.Hello(v=3, nonce="n0", engine=ENGINE, pid=7, max_frame=1 << 20, ring_abi=2, manifest_digest="d",
            kernel_revision="k", packed=True),
    p.HelloAck(v=3, accept=True, max_frame=1 << 20, generation=1),
    p.Load(req_id=1, artifact_path="/m.gguf", artifact_digest="ab", format="gguf", runtime_config={"kind": "x"},
           model_ref="m"),
    p.EmbedBatch(req_id=2, model_ref="m", pooling="mean", normalize=True, items=[{"id": 0, "n_tokens": 2}],
                 raw=b"\x01\x00\x00\x00\x02\x00\x00\x00"),
    p.Rerank(req_id=3, model_ref="m", query_n_tokens=1, candidates=[{"n_tokens": 1}], raw=b"\0" * 8),
    p.Generate(req_id=4, model_ref="m", max_tokens=16, stream=True, temperature=0.5, top_p=0.9, top_k=4, seed=7,
               stop=["\n"], logprobs=2, raw=b"\x05\x00\x00\x00"),
    p.Unload(req_id=5, model_ref="m"),
    p.Ping(req_id=6),
    p.Shutdown(req_id=7, mode="graceful"),
    p.Cancel(req_id=4),
    p.Loaded(req_id=1, model_ref="m", dims=4, cold_load_ms=1.5),
    p.Vectors(req_id=2, dims=1, n=1, raw=b"\0\0\x80?"),
    p.Scores(req_id=3, n=1, method="cross_encoder", raw=b"\0\0\x80?"),
    p.Text(req_id=4, text="hi", n_prompt=1, n_gen=1, finish_reason="length", logprobs=[{"token": "hi"}],
           raw=b"\x06\x00\x00\x00"),
    p.TextDelta(req_id=4, text="h", n_gen=1, logprobs=[{"token": "h"}]),
    p.GeneratePacked(req_id=5, model_ref="m", steps=8, join=[{"seq": 3, "n_tokens": 2, "max_tokens": 4, "stop": ["."]}],
                     leave=[1], live=[2], raw=b"\x01\x00\x00\x00\x02\x00\x00\x00"),
    p.Texts(req_id=5, seqs=[{"seq": 2, "text": "a", "n_gen": 3, "ids": [7], "finish_reason": None},
                            {"seq": 3, "text": "b.", "n_gen": 1, "ids": [9], "finish_reason": "stop"}],
            failed=[{"seq": 4, "code": "invalid_request", "msg": "no"}]),
    p.Unloaded(req_id=5),
    p.Pong(req_id=6, rss_mb=10.5, models_loaded=["m"], placement_share=0.5),
    p.WorkerStopped(reason="graceful", req_id=7),
    p.Err(req_id=4, code="invalid_request", msg="no"),
    p.Progress(req_id=4, completed=1, phase="inference"),
    p.WorkerFatal(reason="arena_map_failed", msg="no arena"),
    p.RingReadable(ring_id=1),
    p.RingWritable(ring_id=1),
    p.ConfigureRole(req_id=8, role_id="r", config={"kind": "echo"}),
    p.RoleConfigured(req_id=8, role_id="r"),
    p.RoleFailed(req_id=8, role_id="r", reason="bad", msg="why"),
    p.InstallRing(req_id=9, ring_id=1, edge_id="e", port_id="in", direction="ingress",
                  layout={"offset": 0, "header_len": 64, "capacity": 4096}, object_spec={"dtype": "u8"}),
    p.RingInstalled(req_id=9, ring_id=1, edge_id="e", port_id="in"),
    p.RingFault(ring_id=1, edge_id="e", port_id="in", reason="ring_faulted", req_id=9, msg="why"),
    p.UninstallRing(ring_id=1, reason="edge_stopped", req_id=10),
    p.RingQuiesced(ring_id=1, req_id=10),
    p.ExecuteStep(req_id=11, role_id="r", step_id=1, inputs=[STEP_INPUT], outputs=[STEP_OUTPUT], runtime={},
                  release_inputs_after=False),
    p.ObjectProduced(req_id=11, ring_id=2, port_id="out", object_id=1, sequence=0, extent=8),
    p.StepCompleted(req_id=11, role_id="r", step_id=1),
    p.StepFailed(req_id=11, role_id="r", step_id=1, reason="bad", msg="why"),
    p.ReleaseDeviceObject(req_id=12, device_handle=HANDLE),
    p.DeviceObjectReleased(req_id=12, device_handle=HANDLE),
    p.ReleaseFailed(req_id=12, reason="invalid_device_handle", device_handle=HANDLE, msg="gone"),
    p.ObjectLoaded(ring_id=1, edge_id="e", port_id="in", object_id=1, sequence=0, extent=8, device_handle=HANDLE),
    p.ObjectsLoaded(ring_id=1, edge_id="e", port_id="in", worker_generation=1, objects=[[1, 0, 8, 2]]),
    p.LoadedBlock(ring_id=1, edge_id="e", port_id="in", worker_generation=1, raw=bytes(range(32))),
    p.ObjectFailed(ring_id=1, edge_id="e", port_id="in", reason="bad", msg="why", object_id=1, sequence=0),
]


# --- the derived tables are the old ones ---------------------------------------------------------------------


# Restricted to the frozen names: a message added later is not in them, and none may be lost or changed.


def test_schemas_equal_the_hand_written_tables() -> None:
    derived = {t: (s.sender, " ".join(s.required), " ".join(s.optional), s.raw, s.exact) for t, s in SCHEMAS.items()}
    assert {t: derived.get(t) for t in frozen.SCHEMAS} == frozen.SCHEMAS
    # check_fields reports the first bad field, so the order of the fields is behaviour, checked above; and
    # the old messages keep their relative order
    assert [t for t in derived if t in frozen.SCHEMAS] == list(frozen.SCHEMAS)


def test_terminal_and_intermediate_equal_the_hand_written_tables() -> None:
    assert {t: sorted(TERMINAL.get(t, ())) for t in frozen.TERMINAL} == frozen.TERMINAL
    assert {t: sorted(INTERMEDIATE.get(t, ())) for t in frozen.INTERMEDIATE} == frozen.INTERMEDIATE
    assert all(t in frozen.TERMINAL for t in REQUESTS if t in frozen.SCHEMAS)  # no old message became a request


def test_every_field_check_answers_as_before() -> None:
    derived = {f"{t}.{name}": "".join("1" if check(v) else "0" for v in PROBES)
               for t, s in SCHEMAS.items() for name, check in (*s.required.items(), *s.optional.items())}
    assert {k: derived.get(k) for k in frozen.ACCEPTS} == frozen.ACCEPTS


def test_every_class_has_a_sample_and_a_distinct_name() -> None:
    assert sorted(type(m).T for m in SAMPLES) == sorted(MESSAGES)
    assert all(MESSAGES[type(m).T] is type(m) for m in SAMPLES)


def test_classes_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.Ping(req_id=1).req_id = 2  # type: ignore[misc]


# --- round trips ---------------------------------------------------------------------------------------------


def pair_for(msg: WireMessage) -> tuple[Connection, Connection]:
    """(sender, receiver) ready for `msg`: past the handshake, or at the point of it where `msg` belongs."""
    if isinstance(msg, p.Hello):
        return Connection(WORKER), Connection(DAEMON)
    if isinstance(msg, p.HelloAck):
        worker, daemon = Connection(WORKER), Connection(DAEMON)
        hello = next(m for m in SAMPLES if isinstance(m, p.Hello))
        events(daemon, joined(worker.send(hello)))
        return daemon, worker
    daemon, worker = established()
    return (worker, daemon) if msg.SENDER == WORKER else (daemon, worker)


def untyped_bytes(msg: WireMessage) -> bytes:
    """What the dict-literal senders wrote: fields in schema order, then "t", then raw_len; then the raw frame."""
    fields: dict[str, Any] = {**msg.to_fields(), "t": msg.T}
    raw = msg.payload()
    if raw is None:
        return encode_frame(cbor2.dumps(fields))
    return encode_frame(cbor2.dumps({**fields, "raw_len": len(raw)})) + encode_frame(bytes(raw))


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).T)
def test_each_class_round_trips(msg: WireMessage, feed: Any) -> None:
    sender, receiver = pair_for(msg)
    data = joined(sender.send(msg))
    assert data == untyped_bytes(msg)
    [event] = events(receiver, data, feed)
    assert event == msg


@pytest.mark.parametrize("msg", [m for m in SAMPLES if m.T not in ("HELLO", "HELLO_ACK")], ids=lambda m: m.T)
def test_round_trip_with_trailing_bytes(msg: WireMessage) -> None:
    sender, receiver = pair_for(msg)
    data = joined(sender.send(msg))
    next_frame = joined(sender.send(msg))
    receiver.receive_data(data + next_frame[:3])  # the next frame's prefix, cut short
    event = receiver.next_event()
    assert event == msg
    assert receiver.next_event() is NEED_DATA


def test_a_numbered_request_writes_its_req_id_last() -> None:
    """The daemon's request maps end with req_id (after GENERATE's `last` fields), the bytes workers have always
    read: checked on the decoded map's key order, independently of the class's own field order."""
    daemon, _ = established()
    wire = joined(daemon.send(p.Generate(req_id=9, model_ref="m", max_tokens=4, grammar="g", stream=True,
                                         raw=b"\x01\x00\x00\x00")))
    control = cbor2.loads(wire[4:4 + int.from_bytes(wire[:4], "little")])
    assert list(control)[-5:] == ["grammar", "stream", "req_id", "t", "raw_len"]
    ping = joined(daemon.send(p.Ping(req_id=3)))
    assert list(cbor2.loads(ping[4:])) == ["req_id", "t"]


def test_absent_optionals_stay_absent() -> None:
    assert p.Generate(req_id=1, model_ref="m", max_tokens=4).to_fields() == {"req_id": 1, "model_ref": "m",
                                                                              "max_tokens": 4}
    assert p.Shutdown().to_fields() == {}


def test_decode_builds_the_class_and_drops_undeclared_keys() -> None:
    fields = {"t": "PONG", "req_id": 1, "rss_mb": 1.0, "models_loaded": [], "from_a_newer_peer": 1}
    assert p.decode("PONG", fields) == p.Pong(req_id=1, rss_mb=1.0, models_loaded=[])
    with pytest.raises(MalformedMessage):
        p.decode("NO_SUCH", {"t": "NO_SUCH"})


def test_the_sender_is_the_classes() -> None:
    for msg in SAMPLES:
        if msg.SENDER == BOTH or msg.T in ("HELLO", "HELLO_ACK"):
            continue
        daemon, worker = established()
        wrong = worker if msg.SENDER == DAEMON else daemon
        with pytest.raises(LocalProtocolError):
            wrong.send(msg)


def test_typed_send_validates_like_send() -> None:
    daemon, _ = established()
    with pytest.raises(LocalProtocolError, match="pooling"):
        daemon.send(p.EmbedBatch(req_id=1, model_ref="m", pooling="weightedmean", normalize=True, items=[]))


# --- hypothesis ----------------------------------------------------------------------------------------------

u64 = st.integers(0, (1 << 64) - 1)
words = st.text(max_size=8)
maybe = lambda s: st.none() | s  # noqa: E731
GENERATED = st.one_of(
    st.builds(p.Generate, req_id=u64, model_ref=words, max_tokens=u64, grammar=maybe(words),
              stream=maybe(st.booleans()), temperature=maybe(st.floats(0, 2)), top_p=maybe(st.floats(0, 1)),
              top_k=maybe(u64), seed=maybe(u64),
              stop=maybe(st.lists(words, max_size=3)), logprobs=maybe(st.integers(0, 5)), raw=st.binary(max_size=64)),
    st.builds(p.TextDelta, req_id=u64, text=words, n_gen=u64,
              logprobs=maybe(st.lists(st.dictionaries(words, u64, max_size=2), max_size=2))),
    st.builds(p.ObjectsLoaded, ring_id=u64, edge_id=words, port_id=words, worker_generation=u64,
              objects=st.lists(st.lists(u64, min_size=4, max_size=4), max_size=4)),
    st.builds(p.Shutdown, req_id=maybe(u64), mode=maybe(st.sampled_from(["graceful", "abort_in_flight"]))),
    st.builds(p.Pong, req_id=u64, rss_mb=st.floats(0, 1e6), models_loaded=st.lists(words, max_size=3),
              placement_share=maybe(st.floats(0, 1))),
)


@given(GENERATED, st.sampled_from(FEEDS))
def test_generated_messages_round_trip(msg: WireMessage, feed: Any) -> None:
    sender, receiver = pair_for(msg)
    [event] = events(receiver, joined(sender.send(msg)), feed)
    assert event == msg


# --- the worker dispatches by class --------------------------------------------------------------------------


def test_the_worker_serves_every_request_through_its_table() -> None:
    from trio_gpuworker.worker._engine import Engine

    served_by_the_server = {"SHUTDOWN", "EXECUTE_STEP"}  # on the event loop, not the compute thread
    assert {cls.T for cls in Engine().handlers} == REQUESTS - served_by_the_server


def test_the_worker_answers_a_request_it_lacks_unsupported() -> None:
    from trio_gpuworker._errors import WorkerError
    from trio_gpuworker.worker._engine import Engine

    engine = Engine()
    del engine.handlers[p.Ping]
    with pytest.raises(WorkerError) as info:
        engine.handle(p.Ping(req_id=1), lambda n, phase: None)
    assert info.value.code == "unsupported_request"
    assert isinstance(Engine().handle(p.Ping(req_id=1), lambda n, phase: None), p.Pong)
