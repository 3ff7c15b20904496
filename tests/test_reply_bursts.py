"""Replies are flow-controlled, never counted: a healthy worker whose replies to one request arrive in one read
(an echo step with many outputs writes every OBJECT_PRODUCED and its STEP_COMPLETED at once) is served, not struck;
the queue between the socket reader and the request's task is bounded in bytes and makes the reader wait."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from tests.support.config import dataplane_config
from trio_gpuworker import RestartPolicy, Supervisor, Windows
from trio_gpuworker._errors import UnexpectedFrame
from trio_gpuworker._proto import ObjectProduced, ReplyKind, RequestTracker, Vectors, Verdict
from trio_gpuworker.supervisor._worker import MESSAGE_BYTES, Replies

SPEC = {"kind": "tensor", "max_extent": 1 << 16, "alignment": 4, "dtype": "float32", "shape": [],
        "sequence_policy": "strict"}
WINDOWS = Windows(inference_s=20, setup_s=30, control_s=30, load_s=30, kill_grace_s=1, shutdown_s=5)
OUTPUTS = 200  # the old 64-frame buffer faulted the worker past about 64


async def test_an_echo_step_with_many_outputs_is_served_by_the_same_worker(tmp_path: Path) -> None:
    cfg = dataplane_config(tmp_path, windows=WINDOWS, arena_bytes=16 << 20, restart=RestartPolicy())
    async with Supervisor(cfg) as sup:
        dp, lane = sup.dataplane, sup.lanes["dp"]
        generation = lane.generation
        ingress = await dp.install_ring("dp", direction="ingress", capacity=4096, object_spec=SPEC, port_id="in")
        egress = await dp.install_ring("dp", direction="egress", capacity=1 << 20, object_spec=SPEC, port_id="out")
        data = np.arange(8, dtype=np.float32)
        handle = await dp.load(ingress, data, object_id=1, sequence=0)
        await dp.configure_role("dp", "echo", {"kind": "echo"})
        outputs = [{"port_id": "out", "ring_id": egress.ring_id, "object_id": 100 + k, "sequence": k,
                    "extent": data.nbytes} for k in range(OUTPUTS)]
        got: list[tuple[int, int, np.ndarray]] = []

        async def collect() -> None:
            while len(got) < OUTPUTS:
                got.extend(await dp.pull_many(egress))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect)
            produced = await dp.execute_step("dp", "echo", 1, [{"port_id": "in", "object_id": 1, "sequence": 0,
                                                                 "device_handle": handle}], outputs)
        assert [p["object_id"] for p in produced] == [100 + k for k in range(OUTPUTS)]
        assert [(o, s) for o, s, _ in got] == [(100 + k, k) for k in range(OUTPUTS)]
        for _, _, payload in got:
            np.testing.assert_array_equal(payload.view(np.float32), data)
        assert (lane.generation, lane.restarts, lane.policy.strikes) == (generation, 0, 0)
        await dp.release_handle("dp", handle)
        for end in (ingress, egress):
            await dp.uninstall_ring(end)


def _reply(n: int, raw: int = 0) -> Vectors:
    """Reply number `n` (its `n`), with a raw frame of `raw` bytes."""
    return Vectors(req_id=1, dims=1, n=n, raw=b"x" * raw)


async def test_the_reply_queue_makes_its_reader_wait_once_full_and_never_drops() -> None:
    replies = Replies(limit=4 * MESSAGE_BYTES)
    verdict = Verdict(ReplyKind.INTERMEDIATE)
    for n in range(4):
        await replies.put(_reply(n), verdict)
    done = trio.Event()

    async def reader() -> None:
        await replies.put(_reply(4), verdict)  # the fifth waits for room
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set() and len(replies) == 4
        assert replies.get_nowait()[0].n == 0
        await done.wait()
    assert [(await replies.get())[0].n for _ in range(4)] == [1, 2, 3, 4]
    assert replies.held == 0
    with pytest.raises(trio.WouldBlock):
        replies.get_nowait()


async def test_one_reply_larger_than_the_bound_still_fits_an_empty_queue() -> None:
    replies = Replies(limit=MESSAGE_BYTES)
    await replies.put(_reply(0, raw=1 << 20), Verdict(ReplyKind.TERMINAL))
    assert replies.held == MESSAGE_BYTES + (1 << 20)
    assert replies.get_nowait()[0].raw == b"x" * (1 << 20)


def test_more_object_produced_than_the_step_has_outputs_is_the_workers_fault() -> None:
    tracker = RequestTracker()
    req_id = tracker.begin("EXECUTE_STEP", intermediates=2)
    produced = ObjectProduced(req_id=req_id, ring_id=1, port_id="out", object_id=1, sequence=0, extent=8)
    assert tracker.classify(produced).kind is ReplyKind.INTERMEDIATE
    assert tracker.classify(produced).kind is ReplyKind.INTERMEDIATE
    with pytest.raises(UnexpectedFrame, match="2 outputs"):
        tracker.classify(produced)
