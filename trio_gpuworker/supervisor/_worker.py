"""One worker generation's connection: launch (through the lane's Launcher), handshake, reader, exit watcher,
fault bookkeeping and the kill path."""

from __future__ import annotations

import secrets
import signal
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from .._channel import Held, MessageReader, send_chunks
from .._errors import ProtocolError, RemoteProtocolError, TruncatedStream, UnexpectedFrame
from .._proto import DAEMON, Connection, HandshakeRules, Hello, RequestTracker, Verdict, WireMessage
from ._launcher import Launched, Launcher, WorkerSpec
from ._logring import LogRing

# Replies read from the socket that their request's task has not taken yet. Past this many bytes the reader stops
# reading (the worker's writes then block in the socket): backpressure, never a fault (docs/architecture.md,
# "Replies are flow-controlled").
REPLY_BUFFER_BYTES = 4 << 20
MESSAGE_BYTES = 256  # what one decoded control map is counted as, beside its raw frame


class Replies:
    """The open request's replies, classified as they were read, waiting for the task that serves the request.
    Bounded in bytes: `put` waits while the bound is reached (one reply always fits, however large)."""

    def __init__(self, limit: int = REPLY_BUFFER_BYTES) -> None:
        self.limit = limit
        self.held = 0
        self._items: deque[tuple[WireMessage, Verdict, int]] = deque()
        self._space = trio.lowlevel.ParkingLot()
        self._arrived = trio.lowlevel.ParkingLot()

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, msg: WireMessage, verdict: Verdict) -> None:
        while self.held >= self.limit:
            await self._space.park()
        size = MESSAGE_BYTES + len(msg.payload() or b"")
        self._items.append((msg, verdict, size))
        self.held += size
        self._arrived.unpark_all()

    def get_nowait(self) -> tuple[WireMessage, Verdict]:
        """The oldest reply and its verdict; trio.WouldBlock when none is waiting."""
        if not self._items:
            raise trio.WouldBlock
        msg, verdict, size = self._items.popleft()
        self.held -= size
        self._space.unpark_all()
        return msg, verdict

    async def get(self) -> tuple[WireMessage, Verdict]:
        while not self._items:
            await self._arrived.park()
        return self.get_nowait()


@dataclass
class Fault:
    """Why a generation ended. `cause` is crash | hang | protocol, or ordered for kills we asked for."""

    cause: str
    detail: str
    error: BaseException | None = None


class WorkerProcess:
    def __init__(self, *, lane_id: str, generation: int, argv: list[str], env: dict[str, str], launcher: Launcher,
                 max_frame: int, kill_grace_s: float, drain_s: float, log: LogRing,
                 on_event: Callable[[WorkerProcess, WireMessage], None] | None = None,
                 on_fault: Callable[[Fault], None] | None = None) -> None:
        self.lane_id = lane_id
        self.generation = generation
        self.nonce = secrets.token_hex(16)
        self.spec = WorkerSpec(lane_id, generation, argv, env, self.nonce)
        self.launcher = launcher
        self.max_frame = max_frame
        self.kill_grace_s = kill_grace_s
        self.drain_s = drain_s
        self.log = log
        self.on_event = on_event
        self.on_fault = on_fault  # called once, at the first fault, before anything is cancelled
        self.body: Launched | None = None
        self.stream: trio.abc.Stream | None = None
        self._reader: MessageReader | None = None  # reads self.stream
        self.conn = Connection(DAEMON, max_frame)
        self.fault: Fault | None = None
        self.ordered_stop = False  # set before we shut it down or kill it on purpose: no strike
        self.returncode: int | None = None
        self.hello: Hello | None = None
        self._reader_done: trio.Event | None = None
        self._scopes: list[trio.CancelScope] = []  # everything that runs on this generation's behalf
        self._send_lock = trio.Lock()
        self.tracker = RequestTracker()  # req_ids and the open request of this connection
        self.replies = Replies()

    @property
    def pid(self) -> int | None:
        return self.body.pid if self.body is not None else None

    def fail(self, cause: str, detail: str, error: BaseException | None = None) -> None:
        """Record the first fault, tell the lane, and stop everything this generation runs."""
        if self.fault is None:
            self.fault = Fault("ordered" if self.ordered_stop else cause, detail, error)
            if self.on_fault is not None:
                self.on_fault(self.fault)
        for scope in self._scopes:
            scope.cancel()

    def stop_now(self, detail: str) -> None:
        """End it in order (after WORKER_STOPPED, or before it ever connected): no strike."""
        self.ordered_stop = True
        self.fail("ordered", detail)

    def cancel_on_fault(self, scope: trio.CancelScope) -> None:
        self._scopes.append(scope)
        if self.fault is not None:
            scope.cancel()

    # --- start ---------------------------------------------------------------------------------

    async def start(self, nursery: trio.Nursery, setup_s: float) -> None:
        """Launch, accept the spawned worker only, complete HELLO. Raises nothing: faults are recorded."""
        self.cancel_on_fault(nursery.cancel_scope)
        try:
            with trio.CancelScope(shield=True):  # once it runs it must be known here, or nothing would reap it
                self.body = await self.launcher.launch(self.spec, nursery, self.log)
            nursery.start_soon(self._watch_exit)
            with trio.move_on_after(setup_s) as scope:
                self.stream = await self.body.connect()
                self._reader = MessageReader(self.conn, self.stream)
                await self._handshake()
            if scope.cancelled_caught:
                self.fail("hang", f"no HELLO within the setup window of {setup_s:g} s")
        except ProtocolError as exc:
            self.fail("protocol", f"handshake failed: {exc}", exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:  # it went away mid-handshake
            self.fail("crash", f"control socket broke during the handshake: {exc}", exc)
        except OSError as exc:
            self.fail("crash", f"cannot start worker {self.spec.argv[0]!r}: {exc}", exc)
        finally:
            if self.body is not None:
                self.body.close()  # nothing else may ever connect to this generation
        if self.fault is None:
            nursery.start_soon(self._read_loop)

    async def _handshake(self) -> None:
        hello = await self._receive()
        if hello is None:
            raise UnexpectedFrame("worker closed the socket before HELLO")
        assert self.body is not None and isinstance(hello, Hello)  # the Connection lets nothing else through first
        ack = HandshakeRules(self.nonce, self.body.pid, self.max_frame, self.generation).check_hello(hello)
        self.hello = hello
        await self.send_message(ack)

    # --- background tasks ----------------------------------------------------------------------

    async def _watch_exit(self) -> None:
        assert self.body is not None
        self.returncode = await self.body.wait()
        if self._reader_done is not None:
            # replies the worker wrote before exiting are still in the socket: let the reader deliver them
            with trio.move_on_after(self.drain_s):
                await self._reader_done.wait()
        self.fail("crash", f"worker exited ({describe_exit(self.returncode)})")

    async def _read_loop(self) -> None:
        """Notifications go to `on_event`; a reply is classified against the open request as it is read (one no
        request can own, or one that breaks its request's rules, is a protocol fault at once) and queued for the
        request's task, waiting while the queue is full."""
        self._reader_done = trio.Event()
        try:
            while (msg := await self._receive()) is not None:
                if msg.HINT or getattr(msg, "req_id", None) is None:  # a notification, not a reply
                    if self.on_event is not None:
                        self.on_event(self, msg)
                    continue
                await self.replies.put(msg, self.tracker.classify(msg))
            self.fail("crash", "worker closed the control socket")
        except TruncatedStream as exc:
            self.fail("crash", str(exc), exc)
        except RemoteProtocolError as exc:
            self.fail("protocol", str(exc), exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.fail("crash", f"control socket broke: {exc}", exc)
        finally:
            self._reader_done.set()

    async def _receive(self) -> WireMessage | None:
        assert self._reader is not None
        return await self._reader.receive()

    # --- use -----------------------------------------------------------------------------------

    def encode(self, msg: WireMessage) -> list[bytes | memoryview]:
        """Validate a message and frame it; LocalProtocolError (nothing written) when it breaks the protocol."""
        return self.conn.send(msg)

    async def send_message(self, msg: WireMessage) -> None:
        await self.write(msg.T, self.encode(msg))

    async def write(self, t: str, chunks: list[bytes | memoryview]) -> None:
        assert self.stream is not None
        async with Held(self._send_lock):
            try:
                await send_chunks(self.stream, chunks)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self.fail("crash", f"control socket broke while sending {t}: {exc}", exc)
                raise

    async def close(self, patience_s: float = 0.0) -> int:
        """Kill the process group and reap it (shielded); returns the exit status.

        `patience_s`: after an ordered SHUTDOWN the worker gets this long to exit on its own first.
        """
        with trio.CancelScope(shield=True):
            if self.stream is not None:
                await self.stream.aclose()
            if self.body is None:
                return -1
            if patience_s > 0 and self.body.returncode is None:
                with trio.move_on_after(patience_s):
                    await self.body.wait()
            self.returncode = await self.body.kill(self.kill_grace_s)
        return self.returncode


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
