"""Worker side of the control socket: handshake, then one request at a time.

The socket is read concurrently with the running request (notifications may arrive at any
time); blocking tinygrad work runs in a thread so the event loop stays responsive.
"""

from __future__ import annotations

import collections
import os
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import trio

from .._channel import Held, MessageReader, encode_messages, send_chunks
from .._errors import ArenaMapFailed, GpuWorkerError, OutgoingFrameTooLarge, RemoteProtocolError, WorkerError
from .._lifeline import die_with_the_daemon
from .._proto import (
    DEFAULT_MAX_FRAME,
    EXTENSIONS,
    WORKER,
    Cancel,
    Connection,
    Err,
    ExecuteStep,
    Hello,
    HelloAck,
    Message,
    RingQuiesced,
    RingReadable,
    RingWritable,
    Shutdown,
    UninstallRing,
    WireMessage,
    WorkerFatal,
    WorkerStopped,
    hello_fields,
    is_request,
)
from ._compute import ComputeThread
from ._dataplane import WorkerDataPlane
from ._engine import Engine

COALESCE_BYTES = 1 << 16  # a reply up to this size is joined with the queued notices into one write
# build_flags: the protocol extensions this worker implements (_proto/_extensions.py)
ENGINE_INFO = {"engine": "tinygrad", "version": "0.14.0", "build_flags": list(EXTENSIONS)}


class WorkerServer:
    def __init__(self, stream: trio.SocketStream, nonce: str, compute: ComputeThread | None = None,
                 die_on_eof: bool = False) -> None:
        self.stream = stream
        self.die_on_eof = die_on_eof  # spawned by a daemon (it handed a lifeline over): its EOF ends us at once
        self.nonce = nonce
        self.conn = Connection(WORKER, DEFAULT_MAX_FRAME)
        self._reader = MessageReader(self.conn, stream)
        self.engine = Engine()
        self.engine.post = self.post
        self.cancelled: int | None = None  # the req_id a CANCEL named
        self.compute = compute or ComputeThread()
        self._send_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._drain_wakeups: dict[int, trio.Event] = {}
        self._outbox: collections.deque[tuple[Any, ...]] = collections.deque()
        self._kicked = False
        self._loop_thread: int | None = None  # the event loop's thread, known from the handshake on
        self.stopping: str | None = None

    def post(self, t: str, fields: dict[str, Any], raw: bytes | None = None) -> None:
        """Queue a message without waiting for the event loop (a thread round trip per wake hint, PROGRESS and
        OBJECT_PRODUCED cost a step milliseconds). Every send flushes the queue first, in the same write, so a
        step's messages still precede its terminal reply. From another thread the loop is kicked to flush it; on
        the loop the task that posts writes next (a step's reply), or calls `flush_soon` before it waits."""
        self._outbox.append((t, fields) if raw is None else (t, fields, raw))
        if threading.get_ident() != self._loop_thread:
            self.flush_soon()

    def flush_soon(self) -> None:
        """Have the queued messages written now (any thread): a step about to wait for ring space has posted a
        RING_READABLE its consumer needs first."""
        if not self._kicked:  # cleared before each flush empties the queue, so no message is left behind
            self._kicked = True
            self.token.run_sync_soon(self._kick_outbox)

    def _kick_outbox(self) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self.send_many, [])

    async def send(self, t: str, fields: dict[str, Any], raw: bytes | memoryview | None = None) -> None:
        """Queued notices first, then this message. It is framed before anything is written, so a
        LocalProtocolError (OutgoingFrameTooLarge) leaves the stream untouched."""
        await self._write(self.conn.send(t, fields, raw))

    async def send_message(self, msg: WireMessage) -> None:
        """`send` for a message class."""
        await self._write(self.conn.send_message(msg))

    async def _write(self, chunks: list[bytes | memoryview]) -> None:
        async with Held(self._send_lock):
            queued = self._take_outbox()
            if sum(map(len, chunks)) <= COALESCE_BYTES:  # a small reply rides in the queued notices' write
                await send_chunks(self.stream, [b"".join([queued, *chunks])])
            else:
                await send_chunks(self.stream, [queued, *chunks] if queued else chunks)

    def _take_outbox(self) -> bytes:
        self._kicked = False
        queued = []
        while self._outbox:
            queued.append(self._outbox.popleft())
        return encode_messages(self.conn, queued) if queued else b""

    async def send_many(self, messages: list[tuple[Any, ...]]) -> None:
        """Several small messages in one write: a drain that finished many objects costs one syscall."""
        async with Held(self._send_lock):
            data = self._take_outbox() + (encode_messages(self.conn, messages) if messages else b"")
            if data:
                await send_chunks(self.stream, [data])

    async def receive(self) -> Message | None:
        return await self._reader.receive()

    async def handshake(self) -> None:
        await self.send_message(Hello(**hello_fields(self.nonce, os.getpid(), DEFAULT_MAX_FRAME, ENGINE_INFO)))
        received = await self.receive()
        if received is None:
            raise SystemExit(2)
        ack = received.typed()
        assert isinstance(ack, HelloAck)  # the Connection's handshake table lets nothing else through first
        self.token = trio.lowlevel.current_trio_token()
        self._loop_thread = threading.get_ident()
        try:
            self.engine.dataplane = WorkerDataPlane(ack.generation, self.post, self.engine.models,
                                                    flush=self.flush_soon)
        except ArenaMapFailed as exc:
            await self.send_message(WorkerFatal(reason=exc.code, msg=str(exc)))
            raise

    async def run(self) -> None:
        await self.handshake()
        send_req, recv_req = trio.open_memory_channel[WireMessage](1)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._read_loop, send_req)
            await self._serve_requests(recv_req)  # returns after SHUTDOWN or once the daemon is gone
            nursery.cancel_scope.cancel()

    def _at_once(self) -> dict[type[WireMessage], Callable[[Any], bool]]:
        """What the read loop does the moment a message arrives, past the request that runs; True: handled here,
        False: a request to queue as well. A message that is neither here nor a request is dropped."""
        return {
            UninstallRing: self._on_uninstall,
            Shutdown: self._on_shutdown,
            Cancel: self._on_cancel,
            RingWritable: self._on_writable,
            RingReadable: self._on_readable,
        }

    async def _read_loop(self, send_req: trio.MemorySendChannel[WireMessage]) -> None:
        at_once = self._at_once()
        async with send_req:
            while (received := await self.receive()) is not None:
                msg = received.typed()
                handle = at_once.get(type(msg))
                if (handle is None or not handle(msg)) and is_request(msg.T):
                    await send_req.send(msg)
        if self.die_on_eof:
            # EOF: the daemon is gone, or it is killing us. Do not wait for the compute thread, which may be
            # minutes into a LOAD: everything this worker started goes now.
            die_with_the_daemon("its control socket closed")

    def _on_uninstall(self, msg: UninstallRing) -> bool:
        # a step blocked on this ring's space must not hold the uninstall queued behind it
        self.engine.dataplane.abort_ring(msg.ring_id)
        if msg.req_id is not None:
            return False
        assert self._nursery is not None
        self._nursery.start_soon(self._quiesce, msg)
        return True

    def _on_shutdown(self, msg: Shutdown) -> bool:
        if msg.mode == "abort_in_flight":
            # what runs fails now: a step at its next ring write, EMBED/GENERATE/LOAD at their next
            # PROGRESS (worker_shutting_down); the SHUTDOWN itself is served once it has stopped
            self.stopping = "abort_in_flight"
            self.engine.dataplane.abort_all()
        return False

    def _on_cancel(self, msg: Cancel) -> bool:
        self.cancelled = msg.req_id  # the running GENERATE stops at its next token
        return True

    def _on_writable(self, msg: RingWritable) -> bool:
        self.engine.dataplane.on_writable(msg.ring_id)  # wakes a step blocked on egress space
        return True

    def _on_readable(self, msg: RingReadable) -> bool:
        self._kick_drain(msg.ring_id)
        return True

    async def _quiesce(self, msg: UninstallRing) -> None:
        """The out-of-band UNINSTALL_RING: quiesce once the compute thread is free of the step, then tell."""
        await self.compute.run(self.engine.dataplane.quiesce, msg.ring_id)
        await self.send_message(RingQuiesced(ring_id=msg.ring_id))

    def _kick_drain(self, ring_id: int) -> None:
        """Hints are coalesced per ring: one drainer task per ring, woken, drains until no progress."""
        wakeup = self._drain_wakeups.get(ring_id)
        if wakeup is None:
            wakeup = self._drain_wakeups[ring_id] = trio.Event()
            assert self._nursery is not None
            self._nursery.start_soon(self._drainer, ring_id)
        wakeup.set()

    async def _drainer(self, ring_id: int) -> None:
        dataplane = self.engine.dataplane
        try:
            while True:
                await self._drain_wakeups[ring_id].wait()
                self._drain_wakeups[ring_id] = trio.Event()
                if self.compute.idle and dataplane.drains_on_loop(ring_id):
                    # nothing runs on the compute thread, and nothing can start there before this returns (this
                    # thread alone submits): the drain runs here, without a hand-off to the thread and back
                    notices = dataplane.drain(ring_id, on_loop=True)
                else:
                    notices = await self.compute.run(dataplane.drain, ring_id)
                if notices is None:
                    return  # the ring is gone
                await self.send_many(notices)
                if dataplane.more(ring_id):  # the drain stopped at its chunk size: go on without a hint
                    self._drain_wakeups[ring_id].set()
        finally:
            self._drain_wakeups.pop(ring_id, None)

    async def _serve_requests(self, recv_req: trio.MemoryReceiveChannel[WireMessage]) -> None:
        async with recv_req:
            async for msg in recv_req:
                if isinstance(msg, Shutdown):
                    # both modes end the same way once nothing runs: rings quiesced, device objects freed
                    self.stopping = msg.mode or "graceful"
                    try:
                        quiesced = await self.compute.run(self.engine.dataplane.stop)
                        await self.send_many([("RING_QUIESCED", {"ring_id": r}) for r in quiesced])
                    finally:
                        await self.send_message(WorkerStopped(reason=self.stopping, req_id=msg.req_id))
                    return
                req_id = getattr(msg, "req_id", None)
                assert isinstance(req_id, int)  # every other request names itself (its schema requires it)
                if self.stopping is not None:
                    await self.send_message(Err(req_id=req_id, code="worker_shutting_down",
                                                msg="the worker is shutting down"))
                    continue
                await self._serve_one(msg, req_id)

    async def _serve_one(self, msg: WireMessage, req_id: int) -> None:

        def progress(completed: int, phase: str, post: bool = True) -> None:
            """Completed work: PROGRESS, unless `post` is False (a TEXT_DELTA carries it); stops the request
            here if it was aborted or cancelled."""
            if self.stopping == "abort_in_flight":  # on the compute thread, inside the model's loop
                raise WorkerError("worker_shutting_down", "SHUTDOWN abort_in_flight stopped this request")
            if self.cancelled == req_id:
                raise WorkerError("request_cancelled", "CANCEL stopped this request")
            if post:
                self.post("PROGRESS", {"req_id": req_id, "completed": completed, "phase": phase})

        try:
            # a step's egress writes wait for ring space on the loop, not on the compute thread
            if isinstance(msg, ExecuteStep):
                reply = await self.engine.dataplane.execute_step(msg, progress, self.compute)
            else:
                reply = await self.compute.run(self.engine.handle, msg, progress)
        except WorkerError as exc:
            await self.send_message(Err(req_id=req_id, code=exc.code, msg=exc.message))
            return
        except MemoryError as exc:
            await self.send_message(Err(req_id=req_id, code="oom", msg=f"out of memory: {exc}"))
            return
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            await self.send_message(Err(req_id=req_id, code="worker_internal", msg=f"{type(exc).__name__}: {exc}"))
            return
        try:
            await self.send_message(reply)
        except OutgoingFrameTooLarge as exc:
            # the request was valid, the answer is too big to carry: a typed ERR, and this worker keeps serving
            await self.send_message(Err(req_id=req_id, code="reply_too_large",
                                        msg=f"{reply.T} does not fit the negotiated max_frame: {exc}"))


async def serve(socket_path: str, nonce: str, compute: ComputeThread | None = None, die_on_eof: bool = False) -> int:
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.connect(socket_path)
    stream = trio.SocketStream(sock)
    server = WorkerServer(stream, nonce, compute, die_on_eof)
    try:
        await server.run()
    except BaseException as exc:  # what ends the worker is logged as itself, then its exit code
        return report_exit(exc)
    finally:
        server.compute.close()
        await stream.aclose()
    return 0


def report_exit(exc: BaseException) -> int:
    """Say on stderr (the lane's log ring) what ended the worker, unwrapping trio's exception groups, and pick
    the exit code. Interrupts and SystemExit propagate as themselves."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, KeyboardInterrupt | SystemExit | trio.Cancelled):
        raise exc
    if isinstance(exc, RemoteProtocolError | trio.BrokenResourceError):
        print(f"worker: control connection failed: {exc}", file=sys.stderr)
    elif isinstance(exc, GpuWorkerError):
        print(f"worker: {type(exc).__name__}: {exc}", file=sys.stderr)
    else:
        print("worker: fatal error:", file=sys.stderr)
        traceback.print_exception(exc, file=sys.stderr)
    return 3
