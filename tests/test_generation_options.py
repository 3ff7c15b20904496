"""Streaming, sampling, stop strings, logprobs and long answers from the real SmolLM2 worker, through the real
`openai` client: one daemon, the generation lane alone (each start loads and warms the model)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import trio

from tests.support.config import embedded_default
from tests.support.helpers import hang_up_mid_stream
from tests.support.state import SESSION_STATE
from trio_gpuworker.daemon.config import DEFAULT_LM
from trio_gpuworker.daemon.main import run_daemon

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "What is the capital of France?"}]


async def test_generation_options_through_the_real_worker(tmp_path: Path) -> None:
    env = {"GPUWORKER_STATE_DIR": str(SESSION_STATE), "GPUWORKER_RUNTIME_DIR": str(tmp_path / "run"),
           "GPUWORKER_LISTEN": "127.0.0.1:0"}
    cfg = embedded_default(env)
    sup = cfg.supervisor
    cfg = dataclasses.replace(cfg, supervisor=dataclasses.replace(
        sup, models=tuple(m for m in sup.models if m.id == DEFAULT_LM),
        lanes=tuple(ln for ln in sup.lanes if DEFAULT_LM in ln.models)))
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, cfg)
        base = daemon.binds[0]
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        with client:
            out = await trio.to_thread.run_sync(lambda: calls(client))
            lane = next(iter(daemon.sup.lanes.values()))
            generation = lane.generation
            await lane.reload()  # a new worker generation: the seed still reproduces the text
            out["seeded_after_restart"] = await trio.to_thread.run_sync(lambda: seeded(client, 7))
            await hang_up_mid_stream(base, "/v1/chat/completions", {"model": DEFAULT_LM, "messages": ASK,
                                     "max_tokens": 1500, "stream": True, "temperature": 0.8}, 3)
            out["after_disconnect"] = await trio.to_thread.run_sync(lambda: plain(client))
            strikes = lane.report.status()["strikes"]
        nursery.cancel_scope.cancel()

    greedy = out["greedy"].choices[0].message.content
    assert "Paris" in greedy
    # streamed: the same text, in more than one delta, the role first, finish_reason last, usage at the end
    chunks = out["stream"]
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == greedy and len(deltas) > 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == out["greedy"].choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == out["greedy"].usage.completion_tokens
    # seeded sampling reproduces itself, on this worker and on the next generation; another seed differs
    assert out["seeded"] == out["seeded_again"] == out["seeded_after_restart"]
    assert out["seeded"] != out["other_seed"] and out["seeded"] != greedy
    # a stop string ends the text before it, streamed or not
    cut = greedy[: greedy.index("Paris")]
    assert out["stop"].choices[0].message.content == cut and out["stop"].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in out["stop_stream"] if c.choices) == cut
    # logprobs at temperature 0: the chosen token is the most likely, each alternative list sorted
    lp = out["logprobs"].choices[0].logprobs.content
    assert "".join(t.token for t in lp) == out["logprobs"].choices[0].message.content == greedy
    for t in lp:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob and t.logprob <= 0
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
    assert np.exp(lp[0].logprob) > 0.05
    # past the reference's 64 tokens
    long = out["long"]
    assert long.usage.completion_tokens == 96 and long.choices[0].finish_reason == "length"
    # the stream cut short cost no strike and left the lane serving
    assert strikes == 0 and lane.generation > generation
    assert out["after_disconnect"] == greedy


def plain(client: openai.OpenAI) -> str:
    r = client.chat.completions.create(model=DEFAULT_LM, messages=ASK, max_tokens=16)
    return r.choices[0].message.content or ""


def seeded(client: openai.OpenAI, seed: int) -> str:
    r = client.chat.completions.create(model=DEFAULT_LM, messages=ASK, max_tokens=24, temperature=0.9, top_p=0.95,
                                       seed=seed)
    return r.choices[0].message.content or ""


def calls(client: openai.OpenAI) -> dict[str, Any]:
    chat = client.chat.completions.create
    out: dict[str, Any] = {"greedy": chat(model=DEFAULT_LM, messages=ASK, max_tokens=16)}
    out["stream"] = list(chat(model=DEFAULT_LM, messages=ASK, max_tokens=16, stream=True,
                              stream_options={"include_usage": True}))
    out["seeded"], out["seeded_again"], out["other_seed"] = seeded(client, 7), seeded(client, 7), seeded(client, 8)
    out["stop"] = chat(model=DEFAULT_LM, messages=ASK, max_tokens=16, stop=["Paris", "London"])
    out["stop_stream"] = list(chat(model=DEFAULT_LM, messages=ASK, max_tokens=16, stop="Paris", stream=True))
    out["logprobs"] = chat(model=DEFAULT_LM, messages=ASK, max_tokens=16, logprobs=True, top_logprobs=2)
    out["long"] = client.completions.create(model=DEFAULT_LM, prompt="Once upon a time, in a land far away,",
                                            max_tokens=96, extra_body={"top_k": 40}, temperature=0.7, seed=3)
    return out
