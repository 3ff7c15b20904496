"""GENERATE (SmolLM2) and RERANK (MiniLM bi-encoder) through real worker processes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest
import trio

from tests.support.config import embedded_default
from tests.support.state import SESSION_STATE, short_dir
from trio_gpuworker import InvalidRequest, Supervisor
from trio_gpuworker._proto import Generate
from trio_gpuworker.daemon.config import DEFAULT_LM, DEFAULT_MODEL

pytestmark = pytest.mark.slow
STATE = SESSION_STATE  # the session's shared kernel and JIT caches


@pytest.fixture
async def sup() -> AsyncIterator[Supervisor]:
    env = {"GPUWORKER_STATE_DIR": str(STATE), "GPUWORKER_RUNTIME_DIR": str(short_dir("gw-serve-"))}
    async with Supervisor(embedded_default(env).supervisor) as s:
        yield s


async def test_generate_and_rerank_through_workers(sup: Supervisor) -> None:
    """One daemon for all checks: each start compiles kernels for two models."""
    await check_generate_greedy_with_paced_progress(sup)
    await check_generate_limits(sup)
    await check_rerank_by_bi_encoder_cosine(sup)


async def check_generate_greedy_with_paced_progress(sup: Supervisor) -> None:
    tok = sup.chat_tokenizer(DEFAULT_LM)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = np.asarray(tok.encode(prompt), dtype="<i4")
    progress: list[int] = []
    lane = sup.pick_lane(DEFAULT_LM)
    reply = await lane.call(Generate(model_ref=DEFAULT_LM, max_tokens=8, raw=ids.tobytes()),
                            on_progress=lambda m: progress.append(m.completed))
    gen = np.frombuffer(reply.raw, dtype="<i4").tolist()
    assert reply.n_prompt == len(ids) and reply.n_gen == len(gen) <= 8
    # the first token's PROGRESS at once, later ones paced (worker/_generate.py), each counting every token so far
    assert progress[0] == 1 and progress == sorted(set(progress)) and progress[-1] <= len(gen)
    assert reply.text == tok.decode(gen, skip_special=True)
    assert reply.finish_reason == ("length" if len(gen) == 8 else "stop")
    assert "Paris" in reply.text
    out = await sup.generate(messages=[{"role": "user", "content": "What is the capital of France?"}],
                             model=DEFAULT_LM, max_tokens=8)
    assert out["text"] == reply.text  # greedy: the same prompt gives the same continuation


async def check_generate_limits(sup: Supervisor) -> None:
    with pytest.raises(InvalidRequest):
        await sup.generate("hi", model=DEFAULT_LM, max_tokens=2048)  # the prompt leaves less than that
    constrained = await sup.generate("hi", model=DEFAULT_LM, max_tokens=4, grammar='root ::= "yes" | "no"')
    assert constrained["text"] in ("yes", "no") and constrained["finish_reason"] == "stop"


async def check_rerank_by_bi_encoder_cosine(sup: Supervisor) -> None:
    query = "How do I bake bread?"
    docs = ["Knead the dough and let it rise before baking.", "The stock market fell today.",
            "Bread needs flour, water, yeast and an oven."]
    scores, method = await sup.rerank(query, docs, model=DEFAULT_MODEL)
    assert method == "bi_encoder_cosine"
    vecs = await sup.embed([query, *docs], model=DEFAULT_MODEL)
    np.testing.assert_allclose(scores, vecs[1:] @ vecs[0], atol=1e-5)
    assert int(np.argmin(scores)) == 1
    with trio.fail_after(60):
        empty, _ = await sup.rerank(query, [], model=DEFAULT_MODEL)
    assert empty.shape == (0,)
