"""Worker side of the control socket: handshake, then one request at a time.

The socket is read concurrently with the running request (notifications may arrive at any
time); blocking tinygrad work runs in a thread so the event loop stays responsive.
"""

from __future__ import annotations

import collections
import os
import socket
import sys
import traceback
from typing import Any

import trio

from .._channel import encode_messages, receive_message
from .._errors import ArenaMapFailed, GpuWorkerError, OutgoingFrameTooLarge, RemoteProtocolError, WorkerError
from .._lifeline import die_with_the_daemon
from .._proto import DEFAULT_MAX_FRAME, EXTENSIONS, WORKER, Connection, Message, hello_fields, is_request
from ._compute import ComputeThread
from ._dataplane import WorkerDataPlane
from ._engine import Engine, Reply

# build_flags: the protocol extensions this worker implements (_proto/_extensions.py)
ENGINE_INFO = {"engine": "tinygrad", "version": "0.14.0", "build_flags": list(EXTENSIONS)}


class WorkerServer:
    def __init__(self, stream: trio.SocketStream, nonce: str, compute: ComputeThread | None = None,
                 die_on_eof: bool = False) -> None:
        self.stream = stream
        self.die_on_eof = die_on_eof  # spawned by a daemon (it handed a lifeline over): its EOF ends us at once
        self.nonce = nonce
        self.conn = Connection(WORKER, DEFAULT_MAX_FRAME)
        self.engine = Engine()
        self.engine.post = self.post
        self.cancelled: int | None = None  # the req_id a CANCEL named
        self.compute = compute or ComputeThread()
        self._send_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._drain_wakeups: dict[int, trio.Event] = {}
        self._outbox: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()
        self._kicked = False
        self.stopping: str | None = None

    def post(self, t: str, fields: dict[str, Any]) -> None:
        """From the compute thread: queue a message without waiting for the event loop (a thread round trip
        per wake hint, PROGRESS and OBJECT_PRODUCED cost a step milliseconds). Every send flushes the queue
        first, so a step's messages still precede its terminal reply."""
        self._outbox.append((t, fields))
        if not self._kicked:  # cleared before each flush empties the queue, so no message is left behind
            self._kicked = True
            self.token.run_sync_soon(self._kick_outbox)

    def _kick_outbox(self) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self.send_many, [])

    async def send(self, t: str, fields: dict[str, Any], raw: bytes | memoryview | None = None) -> None:
        """Queued notices first, then this message. It is framed before anything is written, so a
        LocalProtocolError (OutgoingFrameTooLarge) leaves the stream untouched."""
        chunks = self.conn.send(t, fields, raw)
        async with self._send_lock:
            await self._flush_outbox()
            for chunk in chunks:
                await self.stream.send_all(chunk)

    async def _flush_outbox(self) -> None:
        self._kicked = False
        queued = []
        while self._outbox:
            queued.append(self._outbox.popleft())
        if queued:
            await self.stream.send_all(encode_messages(self.conn, queued))

    async def send_many(self, messages: list[tuple[str, dict[str, Any]]]) -> None:
        """Several small messages in one write: a drain that finished many objects costs one syscall."""
        async with self._send_lock:
            await self._flush_outbox()
            if messages:
                await self.stream.send_all(encode_messages(self.conn, messages))

    async def receive(self) -> Message | None:
        return await receive_message(self.conn, self.stream)

    async def handshake(self) -> None:
        await self.send("HELLO", hello_fields(self.nonce, os.getpid(), DEFAULT_MAX_FRAME, ENGINE_INFO))
        ack = await self.receive()
        if ack is None:
            raise SystemExit(2)
        self.token = trio.lowlevel.current_trio_token()
        try:
            self.engine.dataplane = WorkerDataPlane(ack["generation"], self.post, self.engine.models)
        except ArenaMapFailed as exc:
            await self.send("WORKER_FATAL", {"reason": exc.code, "msg": str(exc)})
            raise

    async def run(self) -> None:
        await self.handshake()
        send_req, recv_req = trio.open_memory_channel[Message](1)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._read_loop, send_req)
            await self._serve_requests(recv_req)  # returns after SHUTDOWN or once the daemon is gone
            nursery.cancel_scope.cancel()

    async def _read_loop(self, send_req: trio.MemorySendChannel[Message]) -> None:
        async with send_req:
            while (msg := await self.receive()) is not None:
                if msg.t == "UNINSTALL_RING":
                    # a step blocked on this ring's space must not hold the uninstall queued behind it
                    self.engine.dataplane.abort_ring(msg["ring_id"])
                    if "req_id" not in msg.fields:
                        assert self._nursery is not None
                        self._nursery.start_soon(self._quiesce, msg)
                        continue
                if msg.t == "SHUTDOWN" and msg.get("mode") == "abort_in_flight":
                    # what runs fails now: a step at its next ring write, EMBED/GENERATE/LOAD at their next
                    # PROGRESS (worker_shutting_down); the SHUTDOWN itself is served once it has stopped
                    self.stopping = "abort_in_flight"
                    self.engine.dataplane.abort_all()
                if msg.t == "CANCEL":
                    self.cancelled = msg["req_id"]  # the running GENERATE stops at its next token
                elif is_request(msg.t):
                    await send_req.send(msg)
                elif msg.t == "RING_WRITABLE":
                    self.engine.dataplane.on_writable(msg["ring_id"])  # wakes a step blocked on egress space
                elif msg.t == "RING_READABLE":
                    self._kick_drain(msg["ring_id"])
        if self.die_on_eof:
            # EOF: the daemon is gone, or it is killing us. Do not wait for the compute thread, which may be
            # minutes into a LOAD: everything this worker started goes now.
            die_with_the_daemon("its control socket closed")

    async def _quiesce(self, msg: Message) -> None:
        """The out-of-band UNINSTALL_RING: quiesce once the compute thread is free of the step, then tell."""
        await self.compute.run(self.engine.dataplane.quiesce, msg["ring_id"])
        await self.send("RING_QUIESCED", {"ring_id": msg["ring_id"]})

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
                notices = await self.compute.run(dataplane.drain, ring_id)
                if notices is None:
                    return  # the ring is gone
                await self.send_many(notices)
                if dataplane.more(ring_id):  # the drain stopped at its chunk size: go on without a hint
                    self._drain_wakeups[ring_id].set()
        finally:
            self._drain_wakeups.pop(ring_id, None)

    async def _serve_requests(self, recv_req: trio.MemoryReceiveChannel[Message]) -> None:
        async with recv_req:
            async for msg in recv_req:
                if msg.t == "SHUTDOWN":
                    # both modes end the same way once nothing runs: rings quiesced, device objects freed
                    self.stopping = msg.get("mode", "graceful")
                    try:
                        quiesced = await self.compute.run(self.engine.dataplane.stop)
                        await self.send_many([("RING_QUIESCED", {"ring_id": r}) for r in quiesced])
                    finally:
                        req = {"req_id": msg["req_id"]} if "req_id" in msg.fields else {}
                        await self.send("WORKER_STOPPED", {"reason": self.stopping, **req})
                    return
                if self.stopping is not None:
                    await self.send("ERR", {"req_id": msg["req_id"], "code": "worker_shutting_down",
                                            "msg": "the worker is shutting down"})
                    continue
                await self._serve_one(msg)

    async def _serve_one(self, msg: Message) -> None:
        req_id = msg["req_id"]

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
            if msg.t == "EXECUTE_STEP":  # its egress writes wait for ring space on the loop, not the compute thread
                reply: Reply = await self.engine.dataplane.execute_step(msg, progress, self.compute)
            else:
                reply = await self.compute.run(self.engine.handle, msg, progress)
        except WorkerError as exc:
            await self.send("ERR", {"req_id": req_id, "code": exc.code, "msg": exc.message})
            return
        except MemoryError as exc:
            await self.send("ERR", {"req_id": req_id, "code": "oom", "msg": f"out of memory: {exc}"})
            return
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            await self.send("ERR", {"req_id": req_id, "code": "worker_internal", "msg": f"{type(exc).__name__}: {exc}"})
            return
        try:
            await self.send(reply.t, {"req_id": req_id, **reply.fields}, reply.raw)
        except OutgoingFrameTooLarge as exc:
            # the request was valid, the answer is too big to carry: a typed ERR, and this worker keeps serving
            await self.send("ERR", {"req_id": req_id, "code": "reply_too_large",
                                    "msg": f"{reply.t} does not fit the negotiated max_frame: {exc}"})


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
