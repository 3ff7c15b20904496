"""Batched generation is used only where it is served (supervisor/_genbatch.py): a plain v3 worker, or one whose model
does not batch (it advertises PACKED and answers GENERATE_PACKED unsupported_request), keeps answering every request
one at a time with GENERATE. Scripted workers (tests/support/fakes.py): TEXT "fake <sum of the prompt's ids>"."""

from __future__ import annotations

import tempfile
from pathlib import Path

import trio

from tests.support.config import REAL_WORKER, supervisor_config
from tests.support.fakes import fake_command
from tests.support.reference_llama import gguf_path
from trio_gpuworker import LaneConfig, ModelConfig, Supervisor, SupervisorConfig
from trio_gpuworker.llm_tokenizer import ChatTokenizer
from trio_gpuworker.supervisor._genbatch import _PACKERS, Packer, packer_for

LM = "lm"
PROMPTS = ["one", "two words", "three more words", "and a fourth", "five"]


def config(run: str, command: tuple[str, ...]) -> SupervisorConfig:
    return supervisor_config(Path(run), lanes=(LaneConfig("gen", (LM,), worker_command=command),),
                             models=(ModelConfig(LM, gguf_path(), kind="generate", format="gguf"),), **REAL_WORKER)


async def answers(command: tuple[str, ...]) -> dict[str, object]:
    """Concurrent requests on a worker of `command`, each answered; what the lane's batch did, while it still runs."""
    tok = ChatTokenizer.from_gguf(gguf_path())
    out: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="gw-gbf-") as run:
        async with Supervisor(config(run, command)) as sup:
            async def one(i: int) -> None:
                out[i] = (await sup.generate(PROMPTS[i], model=LM, max_tokens=3))["text"]

            async with trio.open_nursery() as nursery:
                for i in range(len(PROMPTS)):
                    nursery.start_soon(one, i)
            lane = sup.lanes["gen"]
            seen = {"packer": packer_for(lane, LM, {}), "held": _PACKERS.get(lane, {}).get(LM)}
    assert [out[i] for i in range(len(PROMPTS))] == [f"fake {sum(tok.encode(p))}" for p in PROMPTS]
    return seen


async def test_a_plain_v3_worker_gets_generate_one_at_a_time() -> None:
    seen = await answers(fake_command())
    assert seen == {"packer": None, "held": None}  # it advertised no extension: never a batch


async def test_a_model_that_does_not_batch_falls_back_to_generate() -> None:
    seen = await answers(fake_command(stream_token_s=0.001, packed=1))
    held = seen["held"]
    assert seen["packer"] is None and isinstance(held, Packer)  # tried once, then GENERATE from then on
    assert held.unsupported and held.peak >= 1 and not held.live and not held.pending
