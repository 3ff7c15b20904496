"""Replicas: one request's rows spread over a model's idle lanes, on real fake-worker processes.

The fake's row is [sum(ids), n_tokens, item index in its EMBED_BATCH, req_id]."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio

from tests.support.config import MODEL, supervisor_config
from tests.support.fakes import fake_command
from tests.support.supervision import rows
from trio_gpuworker import BatchPolicy, EngineCrashed, LaneState, Supervisor
from trio_gpuworker.supervisor._dispatch import (
    MIN_ROWS_PER_REPLICA,
    MIN_TOKENS_PER_REPLICA,
    replicas_for,
    split_rows,
)


def test_split_rows_deals_lengths_evenly() -> None:
    lengths = [5, 90, 7, 60, 3, 100, 8, 70]
    parts = split_rows(lengths, 2)
    assert sorted(np.concatenate(parts).tolist()) == list(range(8))
    assert all(list(p) == sorted(p) for p in parts)  # each part keeps input order
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert abs(sums[0] - sums[1]) <= max(lengths) - min(lengths)
    assert [len(p) for p in split_rows([1] * 7, 3)] == [3, 2, 2]


def test_a_job_is_worth_a_replica_per_eight_rows_or_per_bucket_of_tokens() -> None:
    assert replicas_for([]) == 1 and replicas_for([3]) == 1
    assert replicas_for([10] * (2 * MIN_ROWS_PER_REPLICA - 1)) == 1  # few short rows: one worker
    assert replicas_for([10] * (4 * MIN_ROWS_PER_REPLICA)) == 4
    # long rows: the work, not the row count, decides (a batch of 8 rows of ~200 tokens is two parts or more)
    assert replicas_for([200] * 8) == 6
    assert replicas_for([MIN_TOKENS_PER_REPLICA]) == 1  # never more parts than rows
    assert replicas_for([MIN_TOKENS_PER_REPLICA] * 2) == 2
    assert replicas_for([MIN_TOKENS_PER_REPLICA - 1, 1]) == 1


async def test_one_request_is_spread_over_idle_replicas(tmp_path: Path) -> None:
    async with Supervisor(supervisor_config(tmp_path, fake_command(), fake_command()),
                          batching=BatchPolicy(256, 0.0)) as sup:
        with trio.fail_after(30):
            while not all(ln.state == LaneState.READY for ln in sup.lanes.values()):  # noqa: ASYNC110
                await trio.sleep(0.01)
        rs = rows(*[3 + (7 * k) % 40 for k in range(4 * MIN_ROWS_PER_REPLICA)])
        got = await sup.embed_rows(rs, model=MODEL, pooling="mean", normalize=False)
        # every row's own vector, in input order, although two workers computed them
        assert np.array_equal(got[:, :2], np.array([[r.sum(), len(r)] for r in rs], dtype=np.float32))
        # item indices restart per worker: two EMBED_BATCHes of half the rows each
        idx = got[:, 2].astype(int)
        assert sorted(idx.tolist()) == sorted(list(range(len(rs) // 2)) * 2)
        # too few rows to share: one worker
        small = rows(*[4] * (2 * MIN_ROWS_PER_REPLICA - 1))
        got = await sup.embed_rows(small, model=MODEL, pooling="mean", normalize=False)
        assert got[:, 2].astype(int).tolist() == list(range(len(small)))
        # few rows, but long ones: worth both workers
        long = rows(*[MIN_TOKENS_PER_REPLICA, MIN_TOKENS_PER_REPLICA + 7, MIN_TOKENS_PER_REPLICA - 3])
        got = await sup.embed_rows(long, model=MODEL, pooling="mean", normalize=False)
        assert np.array_equal(got[:, :2], np.array([[r.sum(), len(r)] for r in long], dtype=np.float32))
        assert sorted(got[:, 2].astype(int).tolist()) == [0, 0, 1]


async def test_a_failing_replica_fails_the_request_with_its_own_error(tmp_path: Path) -> None:
    crash = fake_command("crash_mid_request", once_file=str(tmp_path / "crashed"))
    async with Supervisor(supervisor_config(tmp_path, fake_command("slow", delay=2.0, on_request=0), crash),
                          batching=BatchPolicy(256, 0.0)) as sup:
        with trio.fail_after(10):
            while not all(ln.state == LaneState.READY for ln in sup.lanes.values()):  # noqa: ASYNC110
                await trio.sleep(0.01)
        rs = rows(*[5] * (2 * MIN_ROWS_PER_REPLICA))
        with trio.fail_after(10), pytest.raises(EngineCrashed):
            await sup.embed_rows(rs, model=MODEL, pooling="mean", normalize=False)
        # the healthy replica's part was cancelled, not left queued, and the crashed lane restarts
        with trio.fail_after(10):
            while sup.lanes["lane1"].state != LaneState.READY or sup.lanes["lane0"].queued:  # noqa: ASYNC110
                await trio.sleep(0.01)
        got = await sup.embed_rows(rs, model=MODEL, pooling="mean", normalize=False)
        assert np.array_equal(got[:, :2], np.array([[r.sum(), len(r)] for r in rs], dtype=np.float32))
