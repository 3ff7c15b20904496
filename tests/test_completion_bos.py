"""A plain completion prompt gets the BOS its GGUF asks for (tokenizer.ggml.add_bos_token), as transformers' tokenizer
and llama.cpp's server add it; a chat prompt does not get a second one (its template writes its own specials)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from gguf import GGMLQuantizationType as T  # noqa: E402

from tests.support.config import REAL_WORKER, supervisor_config  # noqa: E402
from tests.support.tiny_gguf import write_llama  # noqa: E402
from tests.support.tiny_vocab import sentencepiece_model, sentencepiece_vocab  # noqa: E402
from trio_gpuworker import LaneConfig, ModelConfig, Supervisor  # noqa: E402
from trio_gpuworker.llm_tokenizer import ChatTokenizer  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog"


async def test_a_plain_prompt_counts_its_bos_and_a_chat_prompt_one(tmp_path: Path) -> None:
    path = write_llama(tmp_path / "spm.gguf", {"attn_q": T.Q8_0}, vocab=sentencepiece_vocab(sentencepiece_model()))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    want = reference(PROMPT)["input_ids"]
    assert want[0] == reference.bos_token_id  # the file asks for a BOS
    model = ModelConfig("lm", path, kind="generate", format="gguf", runtime_config={"max_context": 128})
    cfg = supervisor_config(tmp_path, lanes=(LaneConfig("gen", ("lm",)),), models=(model,),
                            runtime_dir=Path(tempfile.mkdtemp(dir=tmp_path)), **REAL_WORKER)
    async with Supervisor(cfg) as sup:
        plain = await sup.generate(PROMPT, model="lm", max_tokens=1)
        assert plain["n_prompt"] == len(want)
        chat = await sup.generate(model="lm", messages=[{"role": "user", "content": PROMPT}], max_tokens=1)
    tok = ChatTokenizer.from_gguf(path)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    assert chat["n_prompt"] == len(ids) and ids.count(reference.bos_token_id) == 1  # the template's BOS alone
