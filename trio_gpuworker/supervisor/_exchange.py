"""One request on a live worker: checked before a byte is written, then written and read to its terminal
reply under the idle watchdog (docs/architecture.md, 'Idle watchdog'). The rules of which frame belongs where are the
RequestTracker's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import trio

from .._config import Windows
from .._errors import InvalidRequest, LocalProtocolError, OutgoingFrameTooLarge, RequestTooLarge
from .._proto import (
    EXT_CANCEL,
    SERVING,
    Cancel,
    ExecuteStep,
    Generate,
    Load,
    Reply,
    ReplyKind,
    WireMessage,
    advertised,
    describe_extensions,
    required_extensions,
)
from ._jobs import Job
from ._worker import WorkerProcess


def silence_window(windows: Windows, t: str) -> float:
    """The idle window of request `t`. The daemon decides it from the request's kind, never from the phase a
    worker reports: all inference has the fixed inference window (a worker saying `setup` during an EMBED_BATCH
    does not buy itself 600 s); LOAD (and the compilation it does) has the load window."""
    if t in SERVING:
        return windows.inference_s
    return windows.load_s if t == Load.T else windows.control_s


def rejected(t: str, exc: LocalProtocolError) -> InvalidRequest:
    """A request that failed local validation becomes the caller's typed error; the lane goes on serving."""
    if isinstance(exc, OutgoingFrameTooLarge):
        return RequestTooLarge(f"{t} does not fit one frame: {exc}")
    return InvalidRequest(f"{t} rejected before it was sent: {exc}")


async def exchange(wp: WorkerProcess, job: Job, windows: Windows, on_progress: Callable[[], None] | None = None,
                   extend: Callable[[], bool] | None = None) -> Reply:
    """Write one request and read until its terminal reply (or ERR, returned as a message).

    Raises InvalidRequest/RequestTooLarge when the request fails local validation: nothing was written and the
    worker is untouched. On a worker fault the generation is cancelled and this never returns. The watchdog is
    armed before the write, so a stopped worker that never drains the socket is a hang, not a stuck lane.
    `on_progress()` runs for every validated PROGRESS. `extend()`, asked when the window runs out, says whether
    the worker is waiting on us rather than hung (an EXECUTE_STEP blocked on an egress ring nobody pulls): then
    the window starts again instead of striking it.
    """
    assert job.request is not None  # RELOAD never reaches a worker as itself
    has = advertised(wp.hello)
    if missing := required_extensions(job.t, job.request.to_fields()) - has:
        raise InvalidRequest(f"{job.t}: this worker does not support {describe_extensions(missing)} (its HELLO "
                             "did not advertise it)")
    tracker = wp.tracker
    try:
        outputs = job.request.outputs if isinstance(job.request, ExecuteStep) else None
        req_id = tracker.begin(job.t, intermediates=None if outputs is None else len(outputs))
        chunks = wp.encode(dataclasses.replace(job.request, req_id=req_id))
    except LocalProtocolError as exc:
        tracker.abort()
        raise rejected(job.t, exc) from exc
    # a caller that leaves a GENERATE stops it (CANCEL, out of band) where the worker can; else it drains
    cancellable = isinstance(job.request, Generate) and EXT_CANCEL in has
    interrupt: trio.CancelScope | None = None
    if cancellable:
        job.on_abandon = lambda: interrupt.cancel() if interrupt is not None else None
    if job.on_started is not None:
        job.on_started()
    extras: list[WireMessage] = []
    window = silence_window(windows, job.t)
    deadline, written = trio.current_time() + window, False
    while True:
        with trio.CancelScope(deadline=deadline) as watchdog:
            if not written:
                try:
                    await wp.write(job.t, chunks)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    await trio.sleep_forever()  # the write recorded the fault and cancelled this generation
                written = True
            while True:
                if cancellable and job.abandoned:
                    cancellable = False
                    await wp.send_message(Cancel(req_id=req_id))  # a broken socket: recorded, cancels us
                try:  # replies that came in one read are taken without a scheduler pass each
                    msg, verdict = wp.replies.get_nowait()
                except trio.WouldBlock:
                    if not cancellable:
                        msg, verdict = await wp.replies.get()
                    else:
                        with trio.CancelScope() as interrupt:
                            msg, verdict = await wp.replies.get()
                        if interrupt.cancelled_caught:
                            continue
                if verdict.kind is ReplyKind.PROGRESS:
                    if verdict.renews:
                        watchdog.deadline = deadline = trio.current_time() + window
                    if on_progress is not None:
                        on_progress()
                    if job.on_progress is not None and not job.abandoned:
                        job.on_progress(msg)  # PROGRESS or TEXT_DELTA
                    continue
                if verdict.kind is ReplyKind.INTERMEDIATE:
                    extras.append(msg)
                    continue
                return Reply(msg, tuple(extras))
        if not (written and extend is not None and extend()):
            break  # silent for the whole window (a write that never finished included): a hang
        deadline = trio.current_time() + window  # waiting on us, not hung: the window starts again
    wp.fail("hang", f"{job.t} completed no work for {window:g} s (silence window)")
    await trio.sleep_forever()
    raise AssertionError("unreachable")
