"""The worker side of the control socket, for any engine (docs/engines.md, 'What the server does'): HELLO with the
spawn nonce, framing through the sans-I/O Connection, then one request at a time.

The socket is read concurrently with the running request (CANCEL, SHUTDOWN and wake hints may arrive at any time);
the engine's blocking work runs on one compute thread so the event loop stays responsive. Requests reach the engine
by class (`engine.handle`, `engine.extensions()` says what HELLO advertises); the tinygrad worker adds its data plane
by overriding the hooks marked below (worker/_server.py).
"""

from __future__ import annotations

import collections
import os
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import trio

from ._channel import Held, MessageReader, encode_messages, send_chunks
from ._compute import ComputeThread
from ._errors import GpuWorkerError, OutgoingFrameTooLarge, RemoteProtocolError, WorkerError
from ._lifeline import die_with_the_daemon
from ._proto import (
    DEFAULT_MAX_FRAME,
    EXTENSIONS,
    WORKER,
    Cancel,
    Connection,
    Err,
    Hello,
    HelloAck,
    Progress,
    Shutdown,
    WireMessage,
    WorkerStopped,
    hello_fields,
    is_request,
)

COALESCE_BYTES = 1 << 16  # a reply up to this size is joined with the queued notices into one write
ABORT = "abort_in_flight"  # SHUTDOWN's mode that stops what runs


class Served(Protocol):
    """What the server needs of an engine (trio_gpuworker.engine.Engine is one)."""

    name: str
    version: str

    def extensions(self) -> frozenset[str]: ...

    def handle(self, msg: WireMessage, report: Report) -> WireMessage: ...


class Report:
    """One request's completed-work report and stop check, handed to the engine with the request. Calling it queues
    PROGRESS (with `post` False it only checks); `notice` queues another message of the request (a TEXT_DELTA).
    Each raises WorkerError once a CANCEL named the request or SHUTDOWN abort_in_flight arrived."""

    __slots__ = ("req_id", "server")

    def __init__(self, server: EngineServer, req_id: int) -> None:
        self.server, self.req_id = server, req_id

    def __call__(self, completed: int, phase: str, post: bool = True) -> None:
        self.check()
        if post:
            self.server.post(Progress(req_id=self.req_id, completed=completed, phase=phase))

    def check(self) -> None:
        """Raise the request's stop, if it has one (on the compute thread, inside the engine's loop)."""
        if self.server.stopping == ABORT:
            raise WorkerError("worker_shutting_down", "SHUTDOWN abort_in_flight stopped this request")
        if self.server.cancelled == self.req_id:
            raise WorkerError("request_cancelled", "CANCEL stopped this request")

    def notice(self, msg: WireMessage) -> None:
        self.check()
        self.server.post(msg)


class EngineServer:
    def __init__(self, engine: Served, stream: trio.abc.Stream, nonce: str, compute: ComputeThread | None = None,
                 die_on_eof: bool = False, pid: int | None = None) -> None:
        self.engine = engine
        self.stream = stream
        self.die_on_eof = die_on_eof  # spawned by a daemon (it handed a lifeline over): its EOF ends us at once
        self.nonce = nonce
        self.pid = os.getpid() if pid is None else pid
        self.conn = Connection(WORKER, DEFAULT_MAX_FRAME)
        self._reader = MessageReader(self.conn, stream)
        self.cancelled: int | None = None  # the req_id a CANCEL named
        self.compute = compute or ComputeThread()
        self._send_lock = trio.Lock()
        self.nursery: trio.Nursery | None = None
        self._outbox: collections.deque[WireMessage] = collections.deque()
        self._kicked = False
        self._loop_thread: int | None = None  # the event loop's thread, known from the handshake on
        self.stopping: str | None = None

    # --- writing -------------------------------------------------------------------------------

    def post(self, msg: WireMessage) -> None:
        """Queue a message without waiting for the event loop (a thread round trip per wake hint, PROGRESS and
        OBJECT_PRODUCED cost a step milliseconds). Every send flushes the queue first, in the same write, so a
        step's messages still precede its terminal reply. From another thread the loop is kicked to flush it; on
        the loop the task that posts writes next (a step's reply), or calls `flush_soon` before it waits."""
        self._outbox.append(msg)
        if threading.get_ident() != self._loop_thread:
            self.flush_soon()

    def flush_soon(self) -> None:
        """Have the queued messages written now (any thread): a step about to wait for ring space has posted a
        RING_READABLE its consumer needs first."""
        if not self._kicked:  # cleared before each flush empties the queue, so no message is left behind
            self._kicked = True
            self.token.run_sync_soon(self._kick_outbox)

    def _kick_outbox(self) -> None:
        if self.nursery is not None:
            self.nursery.start_soon(self.send_many, [])

    async def send_message(self, msg: WireMessage) -> None:
        """Queued notices first, then this message. It is framed before anything is written, so a
        LocalProtocolError (OutgoingFrameTooLarge) leaves the stream untouched."""
        await self._write(self.conn.send(msg))

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

    async def send_many(self, messages: list[WireMessage]) -> None:
        """Several small messages in one write: a drain that finished many objects costs one syscall."""
        async with Held(self._send_lock):
            data = self._take_outbox() + (encode_messages(self.conn, messages) if messages else b"")
            if data:
                await send_chunks(self.stream, [data])

    # --- the session ---------------------------------------------------------------------------

    async def receive(self) -> WireMessage | None:
        return await self._reader.receive()

    def engine_info(self) -> dict[str, Any]:
        """HELLO's `engine`: build_flags are the extensions the engine implements, in the protocol's order."""
        have = self.engine.extensions()
        return {"engine": self.engine.name, "version": self.engine.version,
                "build_flags": [e for e in EXTENSIONS if e in have]}

    async def handshake(self) -> None:
        await self.send_message(Hello(**hello_fields(self.nonce, self.pid, DEFAULT_MAX_FRAME, self.engine_info())))
        ack = await self.receive()
        if ack is None:
            raise SystemExit(2)
        assert isinstance(ack, HelloAck)  # the Connection's handshake table lets nothing else through first
        self.token = trio.lowlevel.current_trio_token()
        self._loop_thread = threading.get_ident()
        await self.connected(ack)

    async def run(self) -> None:
        await self.handshake()
        send_req, recv_req = trio.open_memory_channel[WireMessage](1)
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self._read_loop, send_req)
            await self._serve_requests(recv_req)  # returns after SHUTDOWN or once the daemon is gone
            nursery.cancel_scope.cancel()

    async def _read_loop(self, send_req: trio.MemorySendChannel[WireMessage]) -> None:
        at_once = self.at_once()
        async with send_req:
            while (msg := await self.receive()) is not None:
                handle = at_once.get(type(msg))
                if (handle is None or not handle(msg)) and is_request(msg.T):
                    await send_req.send(msg)
        if self.die_on_eof:
            # EOF: the daemon is gone, or it is killing us. Do not wait for the compute thread, which may be
            # minutes into a LOAD: everything this worker started goes now.
            die_with_the_daemon("its control socket closed")

    def _on_shutdown(self, msg: Shutdown) -> bool:
        if msg.mode == ABORT:
            # what runs fails now, at its next PROGRESS (worker_shutting_down); the SHUTDOWN itself is served once
            # it has stopped
            self.stopping = ABORT
            self.aborting()
        return False

    def _on_cancel(self, msg: Cancel) -> bool:
        self.cancelled = msg.req_id  # the running GENERATE stops at its next token
        return True

    async def _serve_requests(self, recv_req: trio.MemoryReceiveChannel[WireMessage]) -> None:
        async with recv_req:
            async for msg in recv_req:
                if isinstance(msg, Shutdown):
                    # both modes end the same way once nothing runs
                    self.stopping = msg.mode or "graceful"
                    try:
                        await self.quiesce()
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
        try:
            reply = await self.dispatch(msg, Report(self, req_id))
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

    # --- hooks: what a server for messages beyond protocol v3's requests overrides -------------------------

    async def connected(self, ack: HelloAck) -> None:
        """HELLO_ACK arrived (its `generation` names this worker); nothing has been read past it yet."""

    def at_once(self) -> dict[type[WireMessage], Callable[[Any], bool]]:
        """What the read loop does the moment a message arrives, past the request that runs; True: handled here,
        False: a request to queue as well. A message that is neither here nor a request is dropped."""
        return {Shutdown: self._on_shutdown, Cancel: self._on_cancel}

    def aborting(self) -> None:
        """SHUTDOWN abort_in_flight arrived: what runs should stop at its next chance."""

    async def dispatch(self, msg: WireMessage, report: Report) -> WireMessage:
        """One request's reply, computed on the compute thread."""
        return await self.compute.run(self.engine.handle, msg, report)

    async def quiesce(self) -> None:
        """SHUTDOWN, once nothing runs: release what the session holds before WORKER_STOPPED."""


async def serve_socket(make: Callable[[trio.SocketStream], EngineServer], socket_path: str) -> int:
    """Connect to the daemon's socket for this worker, serve the session, and return the exit code."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.connect(socket_path)
    stream = trio.SocketStream(sock)
    server = make(stream)
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


__all__ = ["ABORT", "EngineServer", "Report", "Served", "report_exit", "serve_socket"]
