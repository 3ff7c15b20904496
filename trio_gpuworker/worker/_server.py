"""The tinygrad worker's server: the engine server (docs/engines.md, 'What the server does') plus its data plane
(docs/architecture.md, 'The worker side'): the arena mapped once HELLO_ACK names the generation, wake hints and the
out-of-band UNINSTALL_RING handled the moment they arrive, EXECUTE_STEP on the event loop, rings quiesced at
SHUTDOWN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from .._compute import ComputeThread
from .._engine_server import EngineServer, Report, serve_socket
from .._errors import ArenaMapFailed
from .._proto import (
    ExecuteStep,
    HelloAck,
    RingQuiesced,
    RingReadable,
    RingWritable,
    UninstallRing,
    WireMessage,
    WorkerFatal,
)
from ._dataplane import WorkerDataPlane
from ._engine import Engine


class WorkerServer(EngineServer):
    engine: Engine

    def __init__(self, stream: trio.abc.Stream, nonce: str, compute: ComputeThread | None = None,
                 die_on_eof: bool = False) -> None:
        super().__init__(Engine(), stream, nonce, compute, die_on_eof)
        self._drain_wakeups: dict[int, trio.Event] = {}

    async def connected(self, ack: HelloAck) -> None:
        try:
            self.engine.dataplane = WorkerDataPlane(ack.generation, self.post, self.engine.models,
                                                    flush=self.flush_soon)
        except ArenaMapFailed as exc:
            await self.send_message(WorkerFatal(reason=exc.code, msg=str(exc)))
            raise

    def at_once(self) -> dict[type[WireMessage], Callable[[Any], bool]]:
        return {
            **super().at_once(),
            UninstallRing: self._on_uninstall,
            RingWritable: self._on_writable,
            RingReadable: self._on_readable,
        }

    def aborting(self) -> None:
        # a step fails at its next ring write, EMBED/GENERATE/LOAD at their next PROGRESS
        self.engine.dataplane.abort_all()

    async def dispatch(self, msg: WireMessage, report: Report) -> WireMessage:
        # a step's egress writes wait for ring space on the loop, not on the compute thread
        if isinstance(msg, ExecuteStep):
            return await self.engine.dataplane.execute_step(msg, report, self.compute)
        return await super().dispatch(msg, report)

    async def quiesce(self) -> None:
        # rings quiesced, device objects freed
        quiesced = await self.compute.run(self.engine.dataplane.stop)
        await self.send_many([RingQuiesced(ring_id=r) for r in quiesced])

    def _on_uninstall(self, msg: UninstallRing) -> bool:
        # a step blocked on this ring's space must not hold the uninstall queued behind it
        self.engine.dataplane.abort_ring(msg.ring_id)
        if msg.req_id is not None:
            return False
        assert self.nursery is not None
        self.nursery.start_soon(self._quiesce, msg)
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
            assert self.nursery is not None
            self.nursery.start_soon(self._drainer, ring_id)
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


async def serve(socket_path: str, nonce: str, compute: ComputeThread | None = None, die_on_eof: bool = False) -> int:
    return await serve_socket(lambda stream: WorkerServer(stream, nonce, compute, die_on_eof), socket_path)
