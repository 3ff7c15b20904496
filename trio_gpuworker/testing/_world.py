"""The schedules' world (docs/testing.md, 'The simulated world'): what the steps of a schedule do to the supervisor,
and the ledger of every request they made: each must end exactly once, typed, within the bound, with a result that
is its own (the content it sent) or a GpuWorkerError."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math
import random
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import trio

from .._errors import GpuWorkerError
from .._proto import Generate, Rerank, Stop
from ..supervisor import Lane, LaneSettings, LoadSpec, Packer, packer_for
from ._schedule import Schedule, Step
from ._simulation import BOUND, HORIZON_S, MODEL, Simulation, WorldShape, run_world

ROLL_TIMEOUT_S = 60.0  # a roll-over's own deadline when the step gives none: within BOUND
BIG_RING = 1 << 20  # a ring of this size is a quarter of the simulation's arena
CANCEL_AFTER_S = (0.0, 0.001, 0.01, 0.05)  # how long a cancelled ring session runs before its cancel scope fires
EPOCH = "SIM_SETTINGS_EPOCH"  # the env key a reload with new settings changes
MODEL_EPOCH = "SIM_MODEL_EPOCH"  # the env key a change of sim-a's settings (its tokenizer, say) changes
TOKENIZE_S = 0.001  # from reading a model's settings to queueing the request (the daemon tokenizes off the loop)
SPEC = {"kind": "tensor", "max_extent": 1 << 20, "alignment": 4, "dtype": "float32", "shape": [],
        "sequence_policy": "strict"}


@dataclass
class Entry:
    """One step's request in the ledger: when it started, when it ended and how."""

    step: Step
    started: float
    done: float | None = None
    outcome: str = ""
    gated: float = 0.0  # how long it waited at the model gate (bounded by the requests admitted before it)


_ENTRY: contextvars.ContextVar[Entry] = contextvars.ContextVar("sim_entry")  # the entry of the running step


@dataclass
class World(Simulation):
    """A Simulation driven by a schedule's steps (`play`)."""

    schedule: Schedule | None = None
    ledger: list[Entry] = field(default_factory=list)
    packers: dict[str, dict[str, Packer]] = field(default_factory=dict)  # lane -> model -> the batch its steps joined
    _changed: trio.Event = field(default_factory=trio.Event)
    _roles: set[tuple[str, int]] = field(default_factory=set)
    _handles: list[tuple[str, dict[str, int], np.ndarray]] = field(default_factory=list)  # (lane, handle, bytes)
    _epoch: int = 0  # the settings a reload brings, numbered
    _model_epoch: int = 0  # sim-a's settings, numbered: what a request admitted now is tokenized with

    async def play(self) -> None:
        """The schedule's steps, each a task of its own started at its time, invariants checked before each; then the
        end, inside the steps' nursery (a parked pull ends only with the close)."""
        assert self.schedule is not None
        t0 = trio.current_time()
        async with trio.open_nursery() as steps:
            for step in self.schedule.steps:
                await trio.sleep_until(t0 + step.at)
                self.check()
                steps.start_soon(self.perform, self.begin(step))
            with trio.move_on_after(BOUND) as waited:
                await self.idle()
            if not waited.cancelled_caught:
                await self.check_settled()
            await self.finish()

    def pending(self) -> list[str]:
        return [str(e.step) for e in self.ledger if e.done is None]

    async def idle(self) -> None:
        while any(e.done is None for e in self.ledger):
            self._changed = trio.Event()
            await self._changed.wait()

    # --- performing a step --------------------------------------------------------------------

    def begin(self, step: Step) -> Entry:
        """The step's ledger entry, made when it is started (so an idle() right after it waits for it too)."""
        entry = Entry(step, trio.current_time())
        self.ledger.append(entry)
        return entry

    async def perform(self, entry: Entry) -> None:
        """Carry the step out and record how it ended: its outcome, or a finding."""
        step = entry.step
        _ENTRY.set(entry)
        try:
            entry.outcome = await getattr(self, f"_{step.action}")(step) or "ok"
        except Exception as exc:
            typed = [e for e in _leaves(exc) if isinstance(e, GpuWorkerError)]
            if typed and len(typed) == len(_leaves(exc)):  # (a session's pulling task may add its own)
                entry.outcome = typed[0].code
            else:  # an untyped error reached a caller
                text = "".join(traceback.format_exception(exc))
                self.found.append(f"{step}: untyped {type(exc).__name__}: {exc}\n{text}")
                entry.outcome = "untyped"
        entry.done = trio.current_time()
        served = entry.done - entry.started - entry.gated
        if served > BOUND and step.action != "park":  # a parked pull waits for its ring's end
            self.found.append(f"{step}: took {served:.1f} s (bound {BOUND:g} s)")
        if entry.gated > BOUND:  # the gate waits for requests admitted before, each within BOUND
            self.found.append(f"{step}: waited {entry.gated:.1f} s at the model gate (bound {BOUND:g} s)")
        self._changed.set()

    def _lane(self, step: Step) -> Lane:
        assert self.sup is not None
        lanes = list(self.sup.lanes.values())
        return lanes[step.lane % len(lanes)]

    def _ids(self, n: int) -> np.ndarray:
        base = self.rng.randrange(1, 1 << 12)
        return np.arange(base, base + n, dtype=np.int32)

    async def _embed(self, step: Step) -> str | None:
        assert self.sup is not None
        rows = [self._ids(1 + (step.arg * (k + 3)) % 17) for k in range(1 + step.arg % 6)]
        out = await self.sup.embed_ids(rows, model=MODEL, pooling="mean", normalize=False, timeout=step.timeout)
        want = np.array([[r.sum(), len(r)] for r in rows], dtype=np.float32)
        if out.shape != (len(rows), 4) or not np.array_equal(out[:, :2], want):
            self.found.append(f"{step}: vectors are not its own: {out[:, :2].tolist()} != {want.tolist()}")
        return None

    async def _rerank(self, step: Step) -> str | None:
        assert self.sup is not None
        q, docs = self._ids(3), [self._ids(1 + k % 5) for k in range(1 + step.arg % 5)]
        raw = np.concatenate([q, *docs]).astype("<i4").tobytes()
        reply = await self.sup.pick_lane(MODEL).call(
            Rerank(model_ref=MODEL, query_n_tokens=len(q), candidates=[{"n_tokens": len(d)} for d in docs],
                   raw=raw), timeout=step.timeout)
        scores = np.frombuffer(reply.raw or b"", dtype="<f4")
        if not np.array_equal(scores, np.array([d.sum() for d in docs], dtype=np.float32)):
            self.found.append(f"{step}: scores are not its own: {scores.tolist()}")
        return None

    async def _generate(self, step: Step) -> str | None:
        """A GENERATE alone (even `arg`), or 1-3 sequences decoded together in GENERATE_PACKED chunks (odd). It is
        admitted through the model gate, as the daemon admits a request, and reads sim-a's settings there: the
        worker that answers must have been started with those settings."""
        assert self.sup is not None
        deadline = trio.current_time() + step.timeout if step.timeout is not None else math.inf
        waiting = trio.current_time()
        async with self.sup.gate.serving(MODEL, deadline):
            _ENTRY.get().gated = trio.current_time() - waiting
            epoch = self._model_epoch
            await trio.sleep(TOKENIZE_S)
            lane = self.sup.pick_lane(MODEL)
            if step.arg % 2:
                return await self._batched(step, lane, epoch)
            ids = self._ids(1 + step.arg % 9)
            reply = await lane.call(Generate(model_ref=MODEL, max_tokens=step.arg, raw=ids.tobytes()),
                                    timeout=step.timeout)
        text, gen = reply.text.rsplit(" g", 1)
        if text != f"sim {int(ids.sum())}":
            self.found.append(f"{step}: text {reply.text!r} is not its own")
        if int(gen) not in self._gens_of(lane):
            self.found.append(f"{step}: answered by generation {gen}, which lane {lane.id} never ran")
        self._check_model_epoch(step, lane, int(gen), epoch)
        return None

    def _check_model_epoch(self, step: Step, lane: Lane, gen: int, epoch: int) -> None:
        assert self.launcher is not None
        proc = self.launcher.procs.get((lane.id, gen))
        served = int(proc.spec.env.get(MODEL_EPOCH, "0")) if proc is not None else epoch
        if served != epoch:
            self.found.append(f"{step}: admitted with sim-a's settings #{epoch}, answered by worker g{gen} started "
                              f"with #{served} (silently wrong: tokenized with one model's settings, served "
                              f"with another's)")

    async def _batched(self, step: Step, lane: Lane, epoch: int) -> str | None:
        fields = {"max_tokens": step.arg}
        packer = packer_for(lane, MODEL, fields)
        if packer is None:
            return "alone"
        self.packers.setdefault(lane.id, {})[MODEL] = packer  # the one packer_for keeps for the lane and model

        async def one(k: int) -> None:
            ids = self._ids(1 + (step.arg + k) % 9)
            got = await packer.generate(dict(fields), ids, timeout=step.timeout, on_delta=None, timing=None)
            if got is None:
                return
            parts = re.split(r"@g(\d+)", got["text"])
            want = "".join(f" {int(ids.sum())}:{n}" for n in range(1, step.arg + 1))
            gens = {int(g) for g in parts[1::2]}
            if "".join(parts[0::2]) != want or len(gens) != 1 or not gens <= self._gens_of(lane):
                self.found.append(f"{step}: sequence {k}'s text {got['text']!r} is not its own, from one worker "
                                  f"of lane {lane.id}")
            for gen in gens:
                self._check_model_epoch(step, lane, gen, epoch)

        async with trio.open_nursery() as nursery:
            for k in range(1 + step.arg % 3):
                nursery.start_soon(one, k)
        return None

    def watch(self, nursery: trio.Nursery) -> None:
        """The batch watcher of every lane (`watch_batches`)."""
        for lane in self.supervisor.lanes.values():
            nursery.start_soon(self.watch_batches, lane)

    async def watch_batches(self, lane: Lane) -> None:
        """After every change of the lane: a worker that holds a batch's live sequences is never stopped for a
        reload or a roll-over (their next chunks are pinned to it; they would fail)."""
        seen: set[int] = set()
        while True:
            await lane.runner.changed.wait()
            for packer in self.packers.get(lane.id, {}).values():
                g = lane.machine.gens.get(packer.generation) if packer.live and packer.generation else None
                if g is not None and g.stop in (Stop.RELOAD, Stop.RETIRE) and g.number not in seen:
                    seen.add(g.number)
                    self.found.append(f"lane {lane.id}: generation {g.number} stopped ({g.stop.value}) while it "
                                      f"held {len(packer.live)} live batched sequence(s)")

    def _gens_of(self, lane: Lane) -> set[int]:
        assert self.launcher is not None
        return {g for (lane_id, g) in self.launcher.procs if lane_id == lane.id}

    async def _load(self, step: Step) -> str | None:
        assert self.sup is not None
        spec = LoadSpec("sim-b", Path(self.sup.config.models[0].path), "0" * 64, "safetensors", {})
        await self._lane(step).load_model(spec, timeout=step.timeout)
        return None

    async def _unload(self, step: Step) -> str | None:
        await self._lane(step).unload_model("sim-b", timeout=step.timeout)
        return None

    async def _reload(self, step: Step) -> str | None:
        """An ordered reload; an odd `arg` brings new settings (a new env), which the worker it starts must have;
        `arg % 4 == 3` changes sim-a's settings, which every lane serving it reloads with."""
        assert self.sup is not None and self.launcher is not None
        if step.arg % 4 == 3:
            return await self._change_model(step)
        lane = self._lane(step)
        settings = self._new_env(lane) if step.arg % 2 else None
        await self.sup.reload_lane(lane.id, timeout=step.timeout, settings=settings)
        if settings is not None:
            self._check_reloaded(step, lane, settings)
        return None

    def _new_env(self, lane: Lane) -> LaneSettings:
        self._epoch += 1
        env = {**lane.cfg.env, EPOCH: str(self._epoch), MODEL_EPOCH: str(self._model_epoch)}
        return LaneSettings(dataclasses.replace(lane.cfg, env=env), dict(lane.loads))

    def _check_reloaded(self, step: Step, lane: Lane, settings: LaneSettings) -> None:
        assert self.launcher is not None
        proc = self.launcher.procs.get((lane.id, lane.generation))
        epoch = int(proc.spec.env.get(EPOCH, "0")) if proc is not None else None
        if epoch is not None and epoch < int(settings.cfg.env[EPOCH]):
            self.found.append(f"{step}: reloaded with {EPOCH}={settings.cfg.env[EPOCH]}, its worker "
                              f"g{lane.generation} was started with {epoch}")

    async def _change_model(self, step: Step) -> str | None:
        """sim-a's settings change, as a configuration reload that changes a model's tokenizer does: through the
        supervisor's model gate, the settings move once the requests admitted before have ended and before any
        admitted after, and the reload of every lane serving it is queued inside the gate."""
        assert self.sup is not None
        entry, waiting = _ENTRY.get(), trio.current_time()
        lanes = [ln for ln in self.sup.lanes.values() if MODEL in ln.loads]
        reloading = []
        async with trio.open_nursery() as reloads:
            async with self.sup.gate.changing({MODEL}):
                entry.gated = trio.current_time() - waiting
                self._model_epoch += 1
                for lane in lanes:
                    reloading.append((lane, self._new_env(lane)))
                    # no deadline, as the daemon's reload has none: a reload given up while queued is dropped
                    # with its settings, and the model's change must not be
                    await reloads.start(functools.partial(self.sup.reload_lane, lane.id,
                                                          settings=reloading[-1][1]))
        for lane, settings in reloading:
            self._check_reloaded(step, lane, settings)
        return None

    async def _roll(self, step: Step) -> str | None:
        """A roll-over (a tuner's kernels taking over), with a deadline inside BOUND when the caller gives none."""
        await self._lane(step).roll_over(timeout=step.timeout if step.timeout is not None else ROLL_TIMEOUT_S)
        return None

    async def _drain(self, step: Step) -> str | None:
        assert self.sup is not None
        self.sup.router.drain(self._lane(step).id)
        return None

    async def _resume(self, step: Step) -> str | None:
        assert self.sup is not None
        self.sup.router.resume(self._lane(step).id)
        return None

    async def _kill(self, step: Step) -> str | None:
        self.kill(self._lane(step), standby=bool(step.arg))
        return None

    async def _hang(self, step: Step) -> str | None:
        self.hang(self._lane(step), standby=bool(step.arg))
        return None

    async def _abort(self, step: Step) -> str | None:
        self._lane(step).abort_in_flight()
        return None

    async def _ring(self, step: Step) -> str | None:
        """A whole data-plane session: rings in and out, an object in, an echo step, the bytes back, release. A
        quarter of those without a deadline use 1 MiB rings (two such sessions fill the arena: installs wait for
        space) and are cancelled from outside after a moment, at whatever await they have reached."""
        if step.timeout is None and step.arg % 4 == 3:
            with trio.move_on_after(CANCEL_AFTER_S[step.arg // 4 % len(CANCEL_AFTER_S)]):
                await self._session(step, BIG_RING)
            return None
        await self._session(step, 4096)
        return None

    async def _session(self, step: Step, capacity: int) -> None:
        assert self.sup is not None and self.sup.dataplane is not None
        dp, lane = self.sup.dataplane, self._lane(step)
        ends = []
        try:
            ingress = await dp.install_ring(lane.id, direction="ingress", capacity=capacity, object_spec=SPEC,
                                            port_id="in", timeout=step.timeout)
            ends.append(ingress)
            egress = await dp.install_ring(lane.id, direction="egress", capacity=capacity, object_spec=SPEC,
                                           port_id="out", timeout=step.timeout)
            ends.append(egress)
            data = self._ids(64 * step.arg).astype(np.float32)
            handle = await dp.load(ingress, data, object_id=1, sequence=0)
            self._handles.append((lane.id, handle, data))
            # a third of the sessions keep their object on the device (for `stale` steps, on any lane, to find)
            await self._echo(step, lane, egress, handle, data, release=step.arg % 3 == 1)
            if step.arg % 3 == 2:
                await dp.release_handle(lane.id, handle)
        finally:
            for end in ends:
                await _uninstall(dp, end)

    async def _echo(self, step: Step, lane: Lane, egress: Any, handle: dict[str, int], data: np.ndarray, *,
                    release: bool) -> None:
        """An echo step of `handle` into `egress`: what comes back must be `data`, the handle's own bytes."""
        assert self.sup is not None and self.sup.dataplane is not None
        dp = self.sup.dataplane
        role = f"echo-{lane.generation}"
        if (lane.id, lane.generation) not in self._roles:
            self._roles.add((lane.id, lane.generation))
            await dp.configure_role(lane.id, role, {"kind": "echo"})
        got: list[Any] = []
        async with trio.open_nursery() as pulling:
            pulling.start_soon(lambda: _pull(dp, egress, got))
            await dp.execute_step(lane.id, role, 1, [{"port_id": "in", "object_id": 1, "sequence": 0,
                                                      "device_handle": handle}],
                                  [{"port_id": "out", "ring_id": egress.ring_id, "object_id": 2, "sequence": 0,
                                    "extent": data.nbytes}], release_inputs_after=release, timeout=step.timeout)
        if not got or not np.array_equal(got[0][2].view(np.float32), data):
            self.found.append(f"{step}: the echoed bytes are not the handle's own (silently wrong data)")

    async def _stale(self, step: Step) -> str | None:
        """An echo step on any lane with any handle a session ever had (released, of another lane, of a dead
        worker): it must fail typed or echo that handle's own bytes, never another object's."""
        assert self.sup is not None and self.sup.dataplane is not None
        if not self._handles:
            return "nothing"
        dp, lane = self.sup.dataplane, self._lane(step)
        # another lane's handles first: a handle resolving on the wrong lane is the silent failure this looks for
        pool = [h for h in self._handles if h[0] != lane.id] or self._handles
        _, handle, data = pool[step.arg % len(pool)]
        ends = []
        try:
            # a decoy kept on this lane's worker: its handle numbers collide with the other lane's, so a handle
            # let through to the wrong lane finds an object there and echoes the decoy's bytes (seen, not a typed
            # "invalid handle" that would hide the defect)
            ingress = await dp.install_ring(lane.id, direction="ingress", capacity=4096, object_spec=SPEC,
                                            port_id="decoy")
            ends.append(ingress)
            await dp.load(ingress, self._ids(64).astype(np.float32) + 0.5, object_id=1, sequence=0)
            egress = await dp.install_ring(lane.id, direction="egress", capacity=4096, object_spec=SPEC,
                                           port_id="out")
            ends.append(egress)
            await self._echo(step, lane, egress, handle, data, release=False)
        finally:
            for end in ends:
                await _uninstall(dp, end)
        return None

    async def _park(self, step: Step) -> str | None:
        """A pull parked on an egress ring nothing writes to: only the ring's end (a reload, a crash, the close)
        may end it, and it must, with a typed RingFault."""
        assert self.sup is not None and self.sup.dataplane is not None
        dp = self.sup.dataplane
        egress = await dp.install_ring(self._lane(step).id, direction="egress", capacity=4096, object_spec=SPEC,
                                       port_id="parked")
        try:
            await dp.pull(egress)
        finally:
            await _uninstall(dp, egress)
        self.found.append(f"{step}: a pull from a ring nothing wrote to returned an object")
        return None

    # --- the end ---------------------------------------------------------------------------------

    def check_end(self) -> None:
        for e in self.ledger:
            if e.done is None:
                self.found.append(f"{e.step}: never answered")
        super().check_end()


def run_schedule(schedule: Schedule, directory: Path) -> list[str]:
    """Play `schedule` in the world it describes (state under `directory`); what it found wrong."""
    world = World(schedule.seed, random.Random(schedule.seed ^ 0x5EED), [], schedule=schedule)
    shape = WorldShape(schedule.lanes, schedule.standby, schedule.strikes, schedule.fault_rate)
    last = schedule.steps[-1].at if schedule.steps else 0.0
    return run_world(world, lambda w: world.play(), shape, directory, last + HORIZON_S)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


async def _uninstall(dp: Any, end: Any) -> None:
    with trio.CancelScope(shield=True):
        try:
            await dp.uninstall_ring(end, timeout=5.0)
        except GpuWorkerError:
            pass


async def _pull(dp: Any, end: Any, got: list[Any]) -> None:
    try:
        got.append(await dp.pull(end))
    except GpuWorkerError:
        pass


__all__ = ["ROLL_TIMEOUT_S", "Entry", "World", "run_schedule"]
