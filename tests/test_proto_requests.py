"""RequestTracker: the open request, which replies belong to it, and when PROGRESS renews the watchdog.

Plain inputs, no I/O, in the way h11 tests its state machine."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_gpuworker._errors import LocalProtocolError, ProgressViolation, RemoteProtocolError, UnexpectedFrame
from trio_gpuworker._proto import MESSAGES, REQUESTS, ReplyKind, RequestTracker, WireMessage, is_request


def msg(t: str, **fields: Any) -> WireMessage:
    """Message `t` with these fields; the fields a test leaves out are None (the tracker reads only its ids and
    counts)."""
    cls = MESSAGES[t]
    return cls(**{f.name: fields.get(f.name) for f in dataclasses.fields(cls) if f.name != "raw"})


def progress(req_id: int, completed: int, phase: str = "inference") -> WireMessage:
    return msg("PROGRESS", req_id=req_id, completed=completed, phase=phase)


def test_requests_are_the_messages_that_have_terminal_replies() -> None:
    assert {"LOAD", "EMBED_BATCH", "RERANK", "GENERATE", "UNLOAD", "PING", "SHUTDOWN", "EXECUTE_STEP",
            "INSTALL_RING"} <= REQUESTS
    for t in ("PROGRESS", "VECTORS", "ERR", "RING_READABLE", "OBJECT_LOADED", "HELLO"):
        assert not is_request(t)


def test_req_ids_increase_and_one_request_is_open_at_a_time() -> None:
    tr = RequestTracker()
    assert tr.begin("PING") == 1 and tr.open is not None and tr.open.t == "PING"
    with pytest.raises(LocalProtocolError):
        tr.begin("PING")
    assert tr.classify(msg("PONG", req_id=1, rss_mb=1.0, models_loaded=[])).kind is ReplyKind.TERMINAL
    assert tr.open is None
    assert tr.begin("UNLOAD") == 2


def test_abort_frees_the_request_without_reusing_its_id() -> None:
    tr = RequestTracker()
    assert tr.begin("EMBED_BATCH") == 1
    tr.abort()
    assert tr.open is None and tr.begin("EMBED_BATCH") == 2 and tr.last_req_id == 2


def test_only_requests_can_be_opened() -> None:
    with pytest.raises(LocalProtocolError):
        RequestTracker().begin("VECTORS")


def test_err_ends_any_request() -> None:
    tr = RequestTracker()
    tr.begin("GENERATE")
    assert tr.classify(msg("ERR", req_id=1, code="grammar_unsupported", msg="no")).kind is ReplyKind.ERROR
    assert tr.open is None


def test_intermediate_replies_precede_the_terminal_one() -> None:
    tr = RequestTracker()
    rid = tr.begin("EXECUTE_STEP")
    produced = msg("OBJECT_PRODUCED", req_id=rid, ring_id=1, port_id="out", object_id=1, sequence=0, extent=8)
    assert tr.classify(produced).kind is ReplyKind.INTERMEDIATE
    assert tr.open is not None
    assert tr.classify(msg("STEP_COMPLETED", req_id=rid, step_id=1)).kind is ReplyKind.TERMINAL


@pytest.mark.parametrize("reply", [
    msg("VECTORS", req_id=2, dims=4, n=1),  # another request's id
    msg("LOADED", req_id=1, model_ref="m", dims=4, cold_load_ms=1.0),  # a reply to something else
    msg("OBJECT_PRODUCED", req_id=1, ring_id=1, port_id="p", object_id=1, sequence=0, extent=8),  # not for EMBED
])
def test_foreign_replies_are_protocol_faults(reply: WireMessage) -> None:
    tr = RequestTracker()
    tr.begin("EMBED_BATCH")
    with pytest.raises(UnexpectedFrame):
        tr.classify(reply)


def test_a_reply_with_no_open_request_is_a_protocol_fault() -> None:
    with pytest.raises(UnexpectedFrame):
        RequestTracker().classify(msg("PONG", req_id=1, rss_mb=1.0, models_loaded=[]))


def test_progress_renews_only_for_completed_work() -> None:
    tr = RequestTracker()
    tr.begin("LOAD")
    first = tr.classify(progress(1, 0, "setup"))
    assert first.kind is ReplyKind.PROGRESS and not first.renews and first.phase == "setup"
    announced = tr.classify(progress(1, 1, "inference"))
    assert announced.renews and announced.phase == "inference" and tr.phase == "inference"
    assert tr.classify(progress(1, 5)).renews


def test_progress_rules_are_enforced() -> None:
    tr = RequestTracker()
    tr.begin("EMBED_BATCH")
    tr.classify(progress(1, 3))
    for bad in (progress(1, 3), progress(1, 4, "setup"), progress(2, 9)):
        with pytest.raises(ProgressViolation):
            tr.classify(bad)
    assert tr.classify(progress(1, 4)).renews


@given(st.lists(st.tuples(st.sampled_from(["PROGRESS", "VECTORS", "ERR", "PONG", "OBJECT_PRODUCED"]),
                          st.integers(0, 3), st.integers(0, 5), st.sampled_from(["setup", "inference", "control"])),
                max_size=20))
def test_any_sequence_ends_at_most_once_and_raises_only_protocol_errors(
        frames: list[tuple[str, int, int, str]]) -> None:
    tr = RequestTracker()
    rid = tr.begin("EMBED_BATCH")
    ended = 0
    for t, id_offset, completed, phase in frames:
        fields: dict[str, Any] = {"req_id": rid + id_offset - 1, "completed": completed, "phase": phase}
        try:
            verdict = tr.classify(msg(t, **fields))
        except RemoteProtocolError:
            continue
        if verdict.kind in (ReplyKind.TERMINAL, ReplyKind.ERROR):
            ended += 1
            assert tr.open is None
            rid = tr.begin("EMBED_BATCH")
    assert tr.last_req_id == ended + 1
