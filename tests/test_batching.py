"""Dynamic batching through Supervisor.embed_rows, on real fake-worker processes.

The fake's row is [sum(ids), n_tokens, item index in the EMBED_BATCH, req_id]: one req_id across callers
proves they shared one EMBED_BATCH, and the item index shows where each caller's rows sat in it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.support.config import MODEL, supervisor_config
from tests.support.fakes import fake_command
from tests.support.helpers import wait_until
from tests.support.supervision import rows
from trio_gpuworker import BatchPolicy, DeadlineExceeded, LaneState, Supervisor
from trio_gpuworker._proto import EmbedBatch
from trio_gpuworker.supervisor import Batcher


@asynccontextmanager
async def batching(tmp_path: Path, *commands: tuple[str, ...], max_items: int = 256,
                   delay_s: float = 0.05) -> AsyncIterator[tuple[Supervisor, Batcher]]:
    async with Supervisor(supervisor_config(tmp_path, *commands), batching=BatchPolicy(max_items, delay_s)) as sup:
        yield sup, sup.batcher


async def embed(sup: Supervisor, rs: list[np.ndarray], out: dict[int, np.ndarray], key: int) -> None:
    out[key] = await sup.embed_rows(rs, model=MODEL, pooling="mean", normalize=False)


async def test_concurrent_requests_share_one_embed_batch(tmp_path: Path) -> None:
    async with batching(tmp_path, fake_command()) as (sup, batcher):
        out: dict[int, np.ndarray] = {}
        inputs = {k: rows(*([k + 2] * (k + 1)), base=10 * k + 1) for k in range(5)}  # caller k: k+1 rows
        async with trio.open_nursery() as nursery:
            for k, rs in inputs.items():
                nursery.start_soon(embed, sup, rs, out, k)
        assert batcher.batches == 1
        req_ids = {float(v[3]) for vecs in out.values() for v in vecs}
        assert len(req_ids) == 1
        for k, rs in inputs.items():
            assert out[k].shape == (len(rs), 4)
            np.testing.assert_array_equal(out[k][:, 0], [r.sum() for r in rs])  # each caller got its own rows
            np.testing.assert_array_equal(out[k][:, 1], [len(r) for r in rs])
        positions = sorted(float(v[2]) for vecs in out.values() for v in vecs)
        assert positions == list(range(15))  # 1+2+3+4+5 rows, each once


async def test_batches_respect_max_items(tmp_path: Path) -> None:
    async with batching(tmp_path, fake_command(), max_items=4) as (sup, batcher):
        out: dict[int, np.ndarray] = {}
        async with trio.open_nursery() as nursery:
            for k in range(3):
                nursery.start_soon(embed, sup, rows(3, 4), out, k)  # 2 rows each: two callers fill a batch
            nursery.start_soon(embed, sup, rows(*[2] * 9), out, 9)  # 9 rows: split over 3 batches
        assert batcher.batches >= 4
        assert max(v[2] for vecs in out.values() for v in vecs) <= 3  # no EMBED_BATCH above 4 rows
        assert out[9].shape == (9, 4)


async def test_batching_off_sends_each_request_alone(tmp_path: Path) -> None:
    async with Supervisor(supervisor_config(tmp_path, fake_command()), batching=BatchPolicy(256, 0.0)) as sup:
        batcher = sup.batcher
        out: dict[int, np.ndarray] = {}
        async with trio.open_nursery() as inner:
            for k in range(3):
                inner.start_soon(embed, sup, rows(3), out, k)
        assert batcher.batches == 0 and len({float(v[0, 3]) for v in out.values()}) == 3


async def test_caller_gone_before_send_is_left_out(tmp_path: Path) -> None:
    """The lane is busy with a slow batch; a second batch waits for it. Its first caller gives up; a later
    caller joins the same batch; only the later caller's rows reach the worker."""
    async with batching(tmp_path, fake_command("slow", delay=0.5, on_request=1), delay_s=0.01) as (sup, batcher):
        out: dict[int, np.ndarray] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(embed, sup, rows(3), out, 0)  # occupies the lane's one slot for 0.5 s
            await wait_until(lambda: sup.lanes["lane0"].state == LaneState.BUSY)
            with pytest.raises(DeadlineExceeded):
                await sup.embed_rows(rows(5, 5), model=MODEL, pooling="mean", normalize=False, timeout=0.1)
            nursery.start_soon(embed, sup, rows(4), out, 2)
        assert batcher.dropped == 1
        assert out[2][0, 2] == 0 and out[2][0, 1] == 4  # alone in its EMBED_BATCH: the gone rows were removed
        assert out[2][0, 3] == out[0][0, 3] + 1


async def test_sent_batch_whose_callers_all_left_is_dropped_by_the_lane(tmp_path: Path) -> None:
    """A batch already queued on the lane (behind a slow direct request) is abandoned when its only caller
    leaves: the lane drops it, so the next request gets the very next req_id."""
    async with batching(tmp_path, fake_command("slow", delay=0.5, on_request=1), delay_s=0.001) as (sup, batcher):
        lane = sup.lanes["lane0"]
        first: list[int] = []

        async def direct() -> None:
            reply = await lane.call(EmbedBatch(model_ref=MODEL, pooling="mean", normalize=False,
                                               items=[{"id": 0, "n_tokens": 2}],
                                               raw=np.array([1, 2], dtype="<i4").tobytes()))
            first.append(int(np.frombuffer(reply.raw, dtype="<f4")[3]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(direct)
            await wait_until(lambda: lane.state == LaneState.BUSY)
            async with trio.open_nursery() as caller:
                caller.start_soon(partial(sup.embed_rows, rows(3), model=MODEL, pooling="mean", normalize=False))
                await wait_until(lambda: lane.queued == 1)  # the batch sits on the lane's queue
                caller.cancel_scope.cancel()  # its only caller leaves
        assert batcher.dropped == 1
        out: dict[int, np.ndarray] = {}
        await embed(sup, rows(3), out, 0)
        assert int(out[0][0, 3]) == first[0] + 1
