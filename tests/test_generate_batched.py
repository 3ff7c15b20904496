"""Batched generation through the daemon (supervisor/_genbatch.py, worker/_genbatch.py): concurrent generate requests
for SmolLM2 on one real worker decode together in GENERATE_PACKED chunks, and each gets what it gets alone."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from tests.support.config import REAL_WORKER, supervisor_config
from tests.support.helpers import wait_until
from tests.support.reference_llama import gguf_path
from tests.support.state import SESSION_STATE
from trio_gpuworker import DeadlineExceeded, EngineCrashed, LaneConfig, ModelConfig, Supervisor, SupervisorConfig
from trio_gpuworker._proto import PACKED_SLOTS, Generate, GeneratePacked, Texts
from trio_gpuworker.llm_tokenizer import ChatTokenizer
from trio_gpuworker.supervisor._genbatch import packer_for

pytestmark = pytest.mark.slow

LM = "lm"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colours:", "The sea is", "import numpy as np\n"]


def config(run: str, env: dict[str, str] | None = None) -> SupervisorConfig:
    model = ModelConfig(LM, gguf_path(), kind="generate", format="gguf", runtime_config={"max_context": 512})
    return supervisor_config(Path(run), lanes=(LaneConfig("gen", (LM,), env=env or {}),), models=(model,),
                             state_dir=SESSION_STATE, runtime_dir=Path(run), arena_bytes=16 << 20, **REAL_WORKER)


@pytest.fixture
async def sup() -> AsyncIterator[Supervisor]:
    with tempfile.TemporaryDirectory(prefix="gw-gb-") as run:
        async with Supervisor(config(run)) as s:
            yield s


async def alone(sup: Supervisor, prompt: str, fields: dict[str, Any]) -> dict[str, Any]:
    """GENERATE as one request on its own, the way a worker without batching answers it."""
    ids = np.asarray(ChatTokenizer.from_gguf(gguf_path()).encode(prompt), dtype="<i4")
    reply = await sup.lanes["gen"].call(Generate(model_ref=LM, **fields, raw=ids.tobytes()))
    return {"text": reply.text, "n_gen": reply.n_gen, "finish_reason": reply.finish_reason}


async def together(sup: Supervisor, asks: list[tuple[str, dict[str, Any]]], stagger_s: float = 0.05,
                   ) -> list[dict[str, Any]]:
    out: list[Any] = [None] * len(asks)

    async def one(i: int) -> None:
        await trio.sleep(i * stagger_s)  # later ones join a batch already decoding
        prompt, kw = asks[i]
        deltas: list[str] = []
        got = await sup.generate(prompt, model=LM, on_delta=(lambda d: deltas.append(d["text"])) if
                                 kw.pop("stream", False) else None, **kw)
        out[i] = {k: got[k] for k in ("text", "n_gen", "finish_reason")} | ({"deltas": deltas} if deltas else {})

    async with trio.open_nursery() as nursery:
        for i in range(len(asks)):
            nursery.start_soon(one, i)
    return out


async def test_concurrent_requests_each_get_what_they_get_alone(sup: Supervisor) -> None:
    asks = [(p, {"max_tokens": 12 + 4 * i}) for i, p in enumerate(PROMPTS)]
    asks[1][1]["stream"] = True
    asks[2][1]["stop"] = [","]
    asks[3][1].update(temperature=0.8, seed=5)
    want = [await alone(sup, p, {**kw, **({"stream": True} if kw.get("stream") else {})}) for p, kw in asks]
    got = await together(sup, [(p, dict(kw)) for p, kw in asks])
    assert "".join(got[1].pop("deltas")) == got[1]["text"]  # the streamed deltas joined are the text
    assert got == want
    packer = packer_for(sup.lanes["gen"], LM, {})
    assert packer is not None and packer.peak == PACKED_SLOTS  # more requests than slots: the batch was full
    assert not packer.live and not packer.pending


async def test_a_caller_that_leaves_frees_its_slot(sup: Supervisor) -> None:
    want = [await alone(sup, p, {"max_tokens": 16}) for p in PROMPTS[:PACKED_SLOTS]]
    errors: list[BaseException] = []

    async def leaver() -> None:
        with pytest.raises(DeadlineExceeded) as info:
            await sup.generate(PROMPTS[-1], model=LM, max_tokens=400, timeout=0.5)
        errors.append(info.value)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(leaver)
        got = await together(sup, [(p, {"max_tokens": 16}) for p in PROMPTS[:PACKED_SLOTS]], stagger_s=0.2)
    assert len(errors) == 1 and got == want  # four more than fit beside it: its slot went to one of them
    packer = packer_for(sup.lanes["gen"], LM, {})
    assert packer is not None and not packer.live


async def test_a_lone_caller_that_drives_the_chunks_still_leaves_at_its_deadline(sup: Supervisor) -> None:
    """Alone, the caller drives every chunk itself, and a chunk is shielded: its deadline must still end its wait at
    the next chunk boundary, not when its 400 tokens are done (seconds later)."""
    packer = packer_for(sup.lanes["gen"], LM, {})
    assert packer is not None
    with pytest.raises(DeadlineExceeded):
        await sup.generate(PROMPTS[-1], model=LM, max_tokens=400, timeout=0.5)  # greedy: all 400 tokens, no EOS
    assert not packer.live and not packer.pending
    # its slot is dropped with the next chunk, and the batch goes on
    want = await alone(sup, PROMPTS[0], {"max_tokens": 8})
    assert await together(sup, [(PROMPTS[0], {"max_tokens": 8})]) == [want]
    assert not packer.live and not packer.leaving


async def test_a_worker_crash_fails_every_sequence_of_the_batch(sup: Supervisor) -> None:
    lane = sup.lanes["gen"]
    failures: list[BaseException] = []
    packer = packer_for(lane, LM, {})
    assert packer is not None

    async def victim(prompt: str) -> None:
        try:
            await sup.generate(prompt, model=LM, max_tokens=400)
        except EngineCrashed as exc:
            failures.append(exc)

    async with trio.open_nursery() as nursery:
        for p in PROMPTS[:3]:
            nursery.start_soon(victim, p)
        await wait_until(lambda: len(packer.live) == 3, within_s=60)
        assert lane.pid is not None
        os.kill(lane.pid, signal.SIGKILL)
    assert len(failures) == 3 and not packer.live
    # the lane restarts and batches again
    want = await alone(sup, PROMPTS[0], {"max_tokens": 8})
    got = await together(sup, [(PROMPTS[0], {"max_tokens": 8})] * 2)
    assert got == [want, want]


async def test_the_batched_graph_restores_from_the_jit_cache(tmp_path: Path) -> None:
    """A worker whose decoder (batched graph included) comes from the JIT cache batches what a built one does."""
    env = {"GPUWORKER_JIT_CACHE": str(tmp_path / "jit")}
    asks = [(p, {"max_tokens": 10}) for p in PROMPTS[:3]]
    answers, logs = [], []
    for _ in range(2):
        with tempfile.TemporaryDirectory(prefix="gw-gb-") as run:
            async with Supervisor(config(run, env)) as s:
                answers.append(await together(s, [(p, dict(kw)) for p, kw in asks]))
                logs.append(s.lanes["gen"].log.tail(1 << 15))
    assert "jit cache miss" in logs[0] and "jit cache hit" in logs[1], logs
    assert answers[0] == answers[1]


async def test_the_worker_refuses_chunks_that_do_not_fit_its_batch(sup: Supervisor) -> None:
    """GENERATE_PACKED straight on the lane: a sequence the worker does not hold is an ERR (the batch ends on both
    sides); a joining prompt it refuses fails that sequence alone."""
    from trio_gpuworker import WorkerError

    lane = sup.lanes["gen"]
    base: dict[str, Any] = {"model_ref": LM, "steps": 2, "leave": []}
    with pytest.raises(WorkerError) as info:
        await lane.call(GeneratePacked(**base, join=[], live=[7], raw=b""))
    assert info.value.code == "invalid_request"
    ids = np.array([1, 2, 3], dtype="<i4")
    joins = [{"seq": 1, "n_tokens": 3, "max_tokens": 4}, {"seq": 2, "n_tokens": 3, "max_tokens": 4000}]
    reply = await lane.call(GeneratePacked(**base, join=joins, live=[], raw=ids.tobytes() * 2))
    assert isinstance(reply, Texts) and reply.failed is not None
    assert [f["seq"] for f in reply.failed] == [2] and reply.failed[0]["code"] == "invalid_request"
    assert [(r["seq"], r["n_gen"]) for r in reply.seqs] == [(1, 3)]  # its first token and two steps
    too_many = [{"seq": 10 + i, "n_tokens": 3, "max_tokens": 4} for i in range(PACKED_SLOTS)]
    with pytest.raises(WorkerError):
        await lane.call(GeneratePacked(**base, join=too_many, live=[1], raw=ids.tobytes() * PACKED_SLOTS))


@pytest.mark.parametrize("handover", ["roll_over", "reload"])
async def test_a_roll_over_or_reload_fails_no_sequence_of_the_batch(sup: Supervisor, handover: str) -> None:
    """The batch's live sequences exist only in the worker that holds them: a roll-over takes over, and an ordered
    reload stops that worker, only once they have finished there; requests that come meanwhile wait and are
    served by the fresh worker. Each answer is what it gets alone."""
    lane = sup.lanes["gen"]
    packer = packer_for(lane, LM, {})
    assert packer is not None
    asks = [(p, {"max_tokens": 24}) for p in PROMPTS[:3]]
    want = [await alone(sup, p, kw) for p, kw in asks]
    before = lane.generation
    got: list[Any] = [None] * len(asks)

    async def one(i: int) -> None:
        prompt, kw = asks[i]
        got[i] = {k: v for k, v in (await sup.generate(prompt, model=LM, **kw)).items()
                  if k in ("text", "n_gen", "finish_reason")}

    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(one, i)
        await wait_until(lambda: len(packer.live) == 2, within_s=60)
        held = lane.generation
        if handover == "roll_over":
            nursery.start_soon(lambda: lane.roll_over(timeout=120))
        else:
            nursery.start_soon(lambda: lane.reload(timeout=120))
        await wait_until(lambda: lane.handing_over, within_s=10)
        nursery.start_soon(one, 2)  # comes during the hand-over: served by the fresh worker
    assert got == want
    assert lane.generation > held >= before and not packer.live
