"""The fake engine in-process (docs/testing.md, 'Fake engines'): a trio task speaking the real wire format (the
sans-I/O Connection) over an in-memory stream, with the data plane on the real arena and native rings, doing what
its FaultPlan says wrong (the same faults as the process fake, _fake_worker.py).

Replies carry their request's content and the answering generation, so the driver can tell a result that reached
the wrong caller or came from the wrong worker: VECTORS rows are [sum(ids), n_tokens, item id, generation],
SCORES are each candidate's sum(ids), TEXT is "sim <sum(ids)> g<generation>".
"""

from __future__ import annotations

import mmap
import os
import random
import struct
from collections.abc import Callable
from typing import Any, NoReturn

import cbor2
import numpy as np
import trio

from .._proto import (
    CLOSED,
    DEFAULT_MAX_FRAME,
    EXT_PACKED,
    Connection,
    EmbedBatch,
    ExecuteStep,
    Generate,
    GeneratePacked,
    Load,
    Ping,
    Rerank,
    RingReadable,
    RingWritable,
    Shutdown,
    UninstallRing,
    Unload,
    WireMessage,
    hello_fields,
    is_request,
)
from ._plan import FaultPlan
from ._sim_rings import SimRings

SERVING = (EmbedBatch, Rerank, Generate, GeneratePacked, ExecuteStep)
BURST = 100  # replies in one burst: more than the 64 frames the reply buffer once counted
OVERSIZE = struct.pack("<I", 0xFFFFFFF0)  # a frame length far past any max_frame
FLOOD = b"fake worker flood " * 7 + b"\n"  # 127 bytes, written 8257 times: ~1 MiB
PONG = {"t": "PONG", "req_id": 0, "rss_mb": 1.0, "models_loaded": []}  # a frame out of place before HELLO_ACK
Output = Callable[[str, bytes], None]  # (stream, bytes): what the worker writes to its stdout or stderr


class SimWorker:
    def __init__(self, stream: trio.abc.HalfCloseableStream, *, nonce: str, pid: int, env: dict[str, str],
                 plan: FaultPlan, on_misbehave: Callable[[int, str], None], generation: int = 0,
                 output: Output | None = None) -> None:
        self.stream, self.nonce, self.pid, self.plan = stream, nonce, pid, plan
        self.on_misbehave = on_misbehave  # (generation, what): the driver's ledger of faults it may be struck for
        self.output: Output = output or (lambda stream, data: None)
        self.rng = random.Random(plan.seed)
        self.conn = Connection("worker")
        self.generation = generation  # the daemon's number for it; HELLO_ACK says it again
        self.served = 0
        self.loads = 0
        self.models: list[str] = []
        self.exit_code: int | None = None
        self.hung = trio.Event()  # set: it stops reading, writing and answering (a hang, or a SIGSTOP)
        self.stopping: str | None = None
        self.abort = trio.Event()
        self.rings: SimRings | None = None
        self.batch: dict[int, list[int]] = {}  # GENERATE_PACKED: seq -> [sum of its prompt ids, max_tokens, n_gen]
        self._arena = _map_arena(env)
        self._send_lock = trio.Lock()
        self._scope = trio.CancelScope()

    # --- process life --------------------------------------------------------------------------

    async def main(self) -> int:
        """Run until it exits; returns its exit code."""
        with self._scope:
            try:
                await self._session()
            except* (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the daemon closed the socket (from whichever task wrote or read): the process exits
        return self.exit_code if self.exit_code is not None else 0

    async def exit(self, code: int) -> NoReturn:
        """The process exits (from any of its tasks)."""
        if self.exit_code is None:
            self.exit_code = code
        self._scope.cancel()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def _session(self) -> None:
        await self._hello()
        ack = await self.receive()
        if ack is None:
            return
        self.generation = ack.generation
        self.rings = SimRings(self, self._arena)
        requests = trio.open_memory_channel[WireMessage](1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_loop, requests[0], nursery)
            async with requests[1]:
                async for msg in requests[1]:
                    await self._serve(msg)
                    if self.stopping is not None and isinstance(msg, Shutdown):
                        await self.exit(0)
            await self.exit(0)  # the daemon closed the socket

    async def _hello(self) -> None:
        """HELLO, or the plan's handshake fault instead."""
        engine = {"engine": "sim", "version": "1", "build_flags": [EXT_PACKED]}
        hello = hello_fields(self.nonce, self.pid, DEFAULT_MAX_FRAME, engine)
        fault = self.plan.handshake if self.plan.handshake is not None and self.plan.claim() else None
        if fault is not None:
            self.misbehave(fault)
        if fault == "crash_before_hello":
            await self.exit(3)
        elif fault == "wrong_nonce":
            hello["nonce"] = "00" * 16 if self.nonce != "00" * 16 else "11" * 16
        elif fault is not None:
            await self.write(_handshake_bytes(fault, self.conn, hello))
            return
        await self.send("HELLO", hello)

    async def _read_loop(self, send: trio.MemorySendChannel[WireMessage], nursery: trio.Nursery) -> None:
        assert self.rings is not None
        async with send:
            while (msg := await self.receive()) is not None:
                if isinstance(msg, Shutdown) and msg.req_id is None:  # abort_in_flight, out of band
                    self.stopping = "abort_in_flight"
                    self.abort.set()
                    self.rings.close_all("worker_shutting_down")
                    nursery.start_soon(self._stop_aborted)
                elif isinstance(msg, UninstallRing) and msg.req_id is None:
                    self.rings.close(msg.ring_id, "invalid_output_ring")
                    nursery.start_soon(self._quiesce_later, msg.ring_id)
                elif is_request(msg.T):
                    await send.send(msg)
                elif isinstance(msg, RingReadable):
                    await self.rings.drain(msg.ring_id)
                elif isinstance(msg, RingWritable):
                    self.rings.writable(msg.ring_id)

    async def _stop_aborted(self) -> None:
        await self.send_all([("RING_QUIESCED", {"ring_id": r}) for r in self.rings.quiesce_all()] if self.rings else [])
        await self.send("WORKER_STOPPED", {"reason": "abort_in_flight"})
        await self.exit(0)

    async def _quiesce_later(self, ring_id: int) -> None:
        assert self.rings is not None
        if self.rings.busy:
            await self.rings.idle.wait()
        self.rings.quiesce(ring_id)
        await self.send("RING_QUIESCED", {"ring_id": ring_id})

    # --- I/O -------------------------------------------------------------------------------------

    async def send(self, t: str, fields: dict[str, Any], raw: bytes | None = None) -> None:
        await self.write(b"".join(bytes(c) for c in self.conn.send_map(t, fields, raw)))

    async def send_all(self, messages: list[tuple[str, dict[str, Any]]]) -> None:
        if messages:
            await self.write(b"".join(bytes(c) for t, f in messages for c in self.conn.send_map(t, f)))

    async def write(self, data: bytes) -> None:
        if self.hung.is_set():
            await trio.sleep_forever()
        async with self._send_lock:
            await self.stream.send_all(data)

    async def receive(self) -> WireMessage | None:
        while True:
            if self.hung.is_set():
                await trio.sleep_forever()
            ev = self.conn.next_event()
            if isinstance(ev, WireMessage):
                return ev
            if ev is CLOSED:
                return None
            self.conn.receive_data(await self.stream.receive_some(65536))

    def misbehave(self, what: str) -> None:
        self.on_misbehave(self.generation, what)

    # --- requests --------------------------------------------------------------------------------

    async def _serve(self, msg: WireMessage) -> None:
        req_id = msg.req_id
        if self.stopping is not None and not isinstance(msg, Shutdown):
            await self.send("ERR", {"req_id": req_id, "code": "worker_shutting_down", "msg": "shutting down"})
            return
        if isinstance(msg, Load):
            self.loads += 1
            await self._load(msg)
        elif isinstance(msg, SERVING):
            self.served += 1
            fault = self.plan.request_fault(self.served, self.rng)
            await self._serve_work(msg, fault if fault is not None and self.plan.claim() else None)
        elif isinstance(msg, Unload):
            if msg.model_ref in self.models:
                self.models.remove(msg.model_ref)
                await self.send("UNLOADED", {"req_id": req_id})
            else:
                await self.send("ERR", {"req_id": req_id, "code": "model_not_loaded", "msg": msg.model_ref})
        elif isinstance(msg, Ping):
            await self.send("PONG", {"req_id": req_id, "rss_mb": 10.0, "models_loaded": list(self.models)})
        elif isinstance(msg, Shutdown):
            self.stopping = "graceful"
            assert self.rings is not None
            await self.send_all([("RING_QUIESCED", {"ring_id": r}) for r in self.rings.quiesce_all()])
            await self.send("WORKER_STOPPED", {"req_id": req_id, "reason": "graceful"})
        else:
            assert self.rings is not None
            reply = await self.rings.request(msg)
            await self.send(reply[0], {"req_id": req_id, **reply[1]})

    async def _load(self, msg: WireMessage) -> None:
        req_id = msg.req_id
        await self.send("PROGRESS", {"req_id": req_id, "completed": 1, "phase": "setup"})
        if self.plan.crashes_in_load(self.loads) and self.plan.claim():
            self.misbehave("crash_during_load")
            await self.exit(4)
        await trio.sleep(self.plan.load_delay(self.loads))
        model_ref = msg.model_ref or os.path.basename(msg.artifact_path)
        if model_ref not in self.models:
            self.models.append(model_ref)
        await self.send("LOADED", {"req_id": req_id, "model_ref": model_ref, "dims": 4, "cold_load_ms": 1.0})

    async def _serve_work(self, msg: WireMessage, how: str | None) -> None:
        req_id = msg.req_id
        if how is not None:
            self.misbehave(how)
        if how == "crash_mid_request":
            await self.exit(5)
        if how in ("hang_silent", "stop_reading", "hang_sigstop"):
            self.hung.set()
            await trio.sleep_forever()
        if how == "regressing_progress":
            await self.send("PROGRESS", {"req_id": req_id, "completed": 2, "phase": "inference"})
            await self.send("PROGRESS", {"req_id": req_id, "completed": 1, "phase": "inference"})
        elif self.plan.burst and isinstance(msg, Generate):  # healthy, and all at once: one write, one read
            await self.send_all([("PROGRESS", {"req_id": req_id, "completed": k, "phase": "inference"})
                                 for k in range(1, BURST + 1)])
        else:
            await self.send("PROGRESS", {"req_id": req_id, "completed": 1, "phase": "inference"})
        if how == "hang_after_progress":
            self.hung.set()
            await trio.sleep_forever()
        if how == "slow":  # longer than the window with no progress: a hang the watchdog must catch
            await self._slow(req_id)
        if self.abort.is_set():
            await self.send("ERR", {"req_id": req_id, "code": "worker_shutting_down", "msg": "aborted"})
            return
        if isinstance(msg, ExecuteStep):
            assert self.rings is not None
            t, fields, raw = await self.rings.execute(msg)
        else:
            t, fields, raw = self.answer(msg)
        if how == "wrong_req_id":
            fields = {**fields, "req_id": req_id + 1}
        if how in ("garbage", "oversize_length"):
            await self.write(struct.pack("<I", 8) + b"\xff" * 8 if how == "garbage" else OVERSIZE)
            await trio.sleep_forever()
        if how == "crash_between_header_and_raw" and raw is not None:
            await self.write(bytes(self.conn.send_map(t, fields, raw)[0]))
            await self.exit(6)
        if how == "flood_stderr":
            for stream in ("stderr", "stdout"):
                self.output(stream, FLOOD * 8257)
        await self.send(t, fields, raw)
        if how == "exit_after_reply":
            await self.exit(0)
        if how == "stop_after_reply":
            self.hung.set()

    async def _slow(self, req_id: int) -> None:
        """The plan's slow_s before the reply, with PROGRESS every progress_every_s if it has one; an abort ends it."""
        every = self.plan.progress_every_s
        with trio.move_on_after(self.plan.slow_s):
            if every is None:
                await self.abort.wait()
            completed = 1
            while not self.abort.is_set():
                with trio.move_on_after(every):
                    await self.abort.wait()
                completed += 1
                await self.send("PROGRESS", {"req_id": req_id, "completed": completed, "phase": "inference"})

    def packed(self, msg: WireMessage) -> tuple[str, dict[str, Any], None]:
        """One GENERATE_PACKED chunk: each live sequence's next tokens, written " <sum>:<n>" per token, then
        "@g<generation>", so the driver can tell a text that moved between workers or was not its own."""
        ids, at = np.frombuffer(msg.raw or b"", dtype="<i4"), 0
        for seq in msg.leave:
            self.batch.pop(seq, None)
        failed = [{"seq": s, "code": "invalid_request", "msg": "not in this batch"} for s in msg.live
                  if s not in self.batch]
        for j in msg.join:
            self.batch[j["seq"]] = [int(ids[at:at + j["n_tokens"]].sum()), j["max_tokens"], 0]
            at += j["n_tokens"]
        seqs = []
        for seq, st in list(self.batch.items()):
            total, most, done = st
            k = min(msg.steps, most - done)
            st[2] = done + k
            seqs.append({"seq": seq, "text": "".join(f" {total}:{done + i + 1}" for i in range(k))
                         + f"@g{self.generation}", "n_gen": st[2], "ids": list(range(k)),
                         "finish_reason": "length" if st[2] >= most else None})
            if st[2] >= most:
                del self.batch[seq]
        return "TEXTS", {"req_id": msg.req_id, "seqs": seqs, **({"failed": failed} if failed else {})}, None

    def answer(self, msg: WireMessage) -> tuple[str, dict[str, Any], bytes | None]:
        if isinstance(msg, GeneratePacked):
            return self.packed(msg)
        req_id, ids = msg.req_id, np.frombuffer(msg.raw or b"", dtype="<i4")
        if isinstance(msg, EmbedBatch):
            rows, at = [], 0
            for item in msg.items:
                n = item["n_tokens"]
                rows.append([float(ids[at:at + n].sum()), float(n), float(item["id"]), float(self.generation)])
                at += n
            out = np.asarray(rows, dtype="<f4").reshape(len(rows), 4)
            return "VECTORS", {"req_id": req_id, "dims": 4, "n": len(rows)}, out.tobytes()
        if isinstance(msg, Rerank):
            at, scores = msg.query_n_tokens, []
            for cand in msg.candidates:
                scores.append(float(ids[at:at + cand["n_tokens"]].sum()))
                at += cand["n_tokens"]
            return "SCORES", {"req_id": req_id, "n": len(scores)}, np.asarray(scores, dtype="<f4").tobytes()
        gen = ids[::-1][: msg.max_tokens].astype("<i4")
        return "TEXT", {"req_id": req_id, "text": f"sim {int(ids.sum())} g{self.generation}", "n_prompt": len(ids),
                        "n_gen": len(gen), "finish_reason": "length"}, gen.tobytes()


def _handshake_bytes(fault: str, conn: Connection, hello: dict[str, Any]) -> bytes:
    """What a handshake fault writes instead of HELLO, as the process fake does."""
    pong = _frame(cbor2.dumps(PONG))
    if fault == "garbage_hello":
        return _frame(b"\xff" + bytes(63))
    if fault == "oversize_hello":
        return OVERSIZE
    if fault == "frame_before_hello":
        return pong
    if fault == "frame_behind_hello":
        return b"".join(bytes(c) for c in conn.send_map("HELLO", hello)) + pong
    assert fault == "v2_hello"
    return _frame(cbor2.dumps({"t": "HELLO", **hello, "v": 2}))


def _frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def _map_arena(env: dict[str, str]) -> mmap.mmap | None:
    fd, size = env.get("GPUWORKER_ARENA_FD"), int(env.get("GPUWORKER_ARENA_BYTES", "0") or 0)
    return mmap.mmap(int(fd), size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) if fd and size else None


__all__ = ["SimWorker"]
