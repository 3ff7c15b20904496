"""lm-evaluation-harness's `local-completions` against a real daemon serving a tiny random GGUF, unmodified: a
multiple-choice (loglikelihood) task written here (its YAML and a local dataset file), run with `--limit`. It
finds the remote tokenizer by itself (/tokenizer_info, /tokenize without a model), sends token-id prompts with
`echo: true` and `logprobs`, and each loglikelihood it reports must be the independent numpy forward pass's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import trio

pytest.importorskip("lm_eval")
pytest.importorskip("gguf")

from tests.support.reference_llama import NumpyLlama, log_softmax
from tests.support.serving import serving
from tests.support.tiny_gguf import write_llama
from trio_gpuworker import ModelConfig
from trio_gpuworker.llm_tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow
MODEL = "tiny"  # the served model's id
DOCS = [
    {"question": "Which is a colour?", "choices": ["red", "seven", "walk"], "answer": 0},
    {"question": "Which is a number?", "choices": ["blue", "three"], "answer": 1},
    {"question": "Which moves?", "choices": ["stone", "table", "river"], "answer": 2},
    {"question": "Unused past the limit", "choices": ["a", "b"], "answer": 0},
]
LIMIT = 3
TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
LL_TOLERANCE = 1e-2  # a sum of a few tokens' logprobs: the worker's float32 kernels against numpy's float32


def pair_ids(tok: ChatTokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The context's and the continuation's ids as lm-eval splits them (`_encode_pair`: the context's trailing
    spaces move to the continuation; the continuation is what the whole adds to the context's encoding)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


async def test_lm_eval_local_completions_loglikelihoods_are_the_references(tmp_path: Path) -> None:
    gguf = write_llama(tmp_path / "tiny.gguf", {})
    (tmp_path / "tasks").mkdir()
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(TASK.format(data=data))
    out_dir = tmp_path / "out"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    async with serving(tmp_path, ModelConfig(MODEL, gguf, kind="generate", format="gguf")) as base:
        with trio.fail_after(300):
            done = await trio.run_process(
                [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
                 "--model_args", f"model={MODEL},base_url={base}/v1/completions,num_concurrent=1,max_retries=1",
                 "--tasks", "tiny_mc", "--include_path", str(tmp_path / "tasks"), "--limit", str(LIMIT),
                 "--output_path", str(out_dir), "--log_samples", "--seed", "0"],
                env=env, capture_stdout=True, capture_stderr=True, check=False)
    log = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == 0, log[-4000:]
    assert "remote tokenizer" in log.lower(), log[-4000:]  # found by itself, not a Hugging Face download

    [samples] = out_dir.rglob("samples_tiny_mc_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert sorted(r["doc_id"] for r in rows) == list(range(LIMIT))
    tok, ref = ChatTokenizer.from_gguf(gguf), NumpyLlama(gguf)
    for row in rows:
        doc = DOCS[row["doc_id"]]
        assert len(row["resps"]) == len(doc["choices"])
        for args, resp in zip(row["arguments"].values(), row["resps"], strict=True):
            context, continuation = args["arg_0"], args["arg_1"]
            assert continuation.strip() in doc["choices"]
            ctx, cont = pair_ids(tok, context, continuation)
            ids = ctx + cont
            lp = log_softmax(ref.row_logits(ids))
            want = sum(float(lp[i - 1, ids[i]]) for i in range(len(ctx), len(ids)))
            got = float(resp[0][0])
            assert abs(got - want) <= LL_TOLERANCE, (row["doc_id"], continuation, got, want)
            greedy = all(int(np.argmax(lp[i - 1])) == ids[i] for i in range(len(ctx), len(ids)))
            assert resp[0][1] in (str(greedy), greedy), (row["doc_id"], continuation, resp, greedy)
    results = json.loads(next(out_dir.rglob("results_*.json")).read_text())
    assert 0.0 <= results["results"]["tiny_mc"]["acc,none"] <= 1.0
