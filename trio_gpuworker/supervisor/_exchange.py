"""One request on a live worker: checked before a byte is written, then written and read to its terminal
reply under the idle watchdog (§5). The rules of which frame belongs where are the RequestTracker's."""

from __future__ import annotations

import dataclasses

import trio

from .._config import Windows
from .._errors import (
    InvalidRequest,
    LocalProtocolError,
    OutgoingFrameTooLarge,
    RemoteProtocolError,
    RequestTooLarge,
    WorkerError,
)
from .._proto import Message, ReplyKind, RequestTracker
from ._jobs import SERVING, Job
from ._worker import WorkerProcess


def silence_window(windows: Windows, t: str, phase: str | None) -> float:
    """The idle window in force for request `t` in `phase` (None: nothing reported yet)."""
    if phase is None:
        phase = "load" if t == "LOAD" else "inference" if t in SERVING else "control"
    if phase == "inference":
        return windows.inference_s
    if phase == "control":
        return windows.control_s
    return windows.load_s if t == "LOAD" or phase == "load" else windows.setup_s


def rejected(t: str, exc: LocalProtocolError) -> InvalidRequest:
    """A request that failed local validation becomes the caller's typed error; the lane goes on serving."""
    if isinstance(exc, OutgoingFrameTooLarge):
        return RequestTooLarge(f"{t} does not fit one frame: {exc}")
    return InvalidRequest(f"{t} rejected before it was sent: {exc}")


async def exchange(wp: WorkerProcess, job: Job, tracker: RequestTracker, windows: Windows) -> Message:
    """Write one request and read until its terminal reply (or ERR, returned as a message).

    Raises InvalidRequest/RequestTooLarge when the request fails local validation: nothing was written and the
    worker is untouched. On a worker fault the generation is cancelled and this never returns. The watchdog is
    armed before the write, so a stopped worker that never drains the socket is a hang, not a stuck lane.
    """
    try:
        req_id = tracker.begin(job.t)
        chunks = wp.encode(job.t, {**job.fields, "req_id": req_id}, job.raw)
    except LocalProtocolError as exc:
        tracker.abort()
        raise rejected(job.t, exc) from exc
    extras: list[Message] = []
    renewed = trio.current_time()
    window = silence_window(windows, job.t, None)
    with trio.CancelScope(deadline=renewed + window) as watchdog:
        try:
            await wp.write(job.t, chunks)
        except (trio.BrokenResourceError, OSError):
            await trio.sleep_forever()  # the write recorded the fault and cancelled this generation
        while True:
            msg = await wp.replies.receive()
            try:
                verdict = tracker.classify(msg)
            except RemoteProtocolError as exc:
                wp.fail("protocol", str(exc), exc)
                await trio.sleep_forever()
            if verdict.kind is ReplyKind.PROGRESS:
                if verdict.renews:
                    renewed = trio.current_time()
                window = silence_window(windows, job.t, verdict.phase)
                watchdog.deadline = renewed + window
                if job.on_progress is not None and not job.abandoned:
                    job.on_progress(msg)
                continue
            if verdict.kind is ReplyKind.INTERMEDIATE:
                extras.append(msg)
                continue
            return dataclasses.replace(msg, extras=tuple(extras)) if extras else msg
    wp.fail("hang", f"{job.t} completed no work for {window:g} s (silence window)")
    await trio.sleep_forever()
    raise AssertionError("unreachable")


def salvage(wp: WorkerProcess, job: Job, tracker: RequestTracker) -> bool:
    """A worker may write its whole reply and exit before the serving task, cancelled with the generation,
    reads it: a complete terminal reply already received still goes to its caller. True if `job` finished."""
    extras: list[Message] = []
    while True:
        try:
            msg = wp.replies.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return False
        kind = tracker.salvage(msg).kind
        if kind is ReplyKind.INTERMEDIATE:
            extras.append(msg)
        elif kind is ReplyKind.ERROR:
            job.finish(error=WorkerError(msg["code"], msg["msg"]))
            return True
        elif kind is ReplyKind.TERMINAL:
            job.finish(result=dataclasses.replace(msg, extras=tuple(extras)) if extras else msg)
            return True

