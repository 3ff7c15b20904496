"""How LOAD and serving use the JIT cache (worker/_warmcache.py, _jitcache.py): replicas building together build each
entry and each shape once and lose nothing; the writer's probe refuses an entry whose restored copy computes
differently; every restored graph runs only on buffers its entry holds; the artifact is checked before anything
cached runs. The toy model of tests/support/jit_restore_child.py keeps these fast."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.jit_restore_child import KEY, Toy
from tests.support.tiny_bert import TINY, write_tiny_bert
from trio_gpuworker.worker import _jitcache as jc
from trio_gpuworker.worker import _jitfile as jf
from trio_gpuworker.worker import _loaders
from trio_gpuworker.worker import _warmcache as wc

SHAPES = [(1,), (2,), (4,), (8,)]


def _grow(cache: str, out: Any) -> None:
    """One replica: the toy's entry, then every shape, sharing the work with whoever runs at the same time."""
    os.environ[jf.ENV] = cache
    logs: list[str] = []
    model, stored, outcome = wc.load_or_build(KEY, Toy, logs.append)
    assert stored is not None, logs
    shapes = wc.ShapeCache(Path(cache), KEY, stored, {}, model.compile, logs.append)
    shapes.provide_all(model, SHAPES, lambda k: None)
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    out.put((outcome, dict(shapes.counts), model(x).tolist(), logs))


def replicas(cache: Path, n: int) -> list[tuple[str, dict[str, int], list[Any], list[str]]]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_grow, args=(str(cache), out)) for _ in range(n)]
    for p in procs:
        p.start()
    got = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return got


def test_replicas_build_each_entry_and_shape_once(tmp_path: Path) -> None:
    together = replicas(tmp_path, 3)
    outcomes = sorted(o for o, *_ in together)
    assert outcomes == ["miss", "waited", "waited"], together  # one built the entry, the others restored it
    # each shape compiled by exactly one of them; the others restored its part
    assert sum(c.get("compiled", 0) for _, c, *_ in together) == len(SHAPES), together
    assert all(c.get("compiled", 0) + c.get("restored", 0) == len(SHAPES) for _, c, *_ in together), together
    assert all(out == together[0][2] for _, _, out, _ in together)  # and they compute the same, bit for bit
    later = replicas(tmp_path, 1)[0]
    assert later[0] == "hit" and later[1] == {"restored": len(SHAPES)} and later[2] == together[0][2], later
    assert not list(tmp_path.glob("*.tmp"))


def test_the_writer_refuses_an_entry_whose_restored_copy_computes_differently(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    model = Toy()
    model.compile((4,))
    replays = []
    real = jc._replay

    def replay(jit: Any) -> str:  # the second replay is the copy's: one weight differs there
        replays.append(jit)
        if len(replays) == 2:
            w1 = next(b for b in jit._linear.toposort() if jc._device_buffer(b) and b.max_numel() == 64 * 64)
            view = w1.buffer.as_memoryview(force_zero_copy=True)
            view[:] = b"\x3f" * len(view)  # every weight 0.75: nothing the relu could hide
        return real(jit)

    monkeypatch.setattr(jc, "_replay", replay)
    path = tmp_path / "toy.jit"
    with pytest.raises(jf.CacheEntryInvalid, match="computes differently"):
        jc.save(path, KEY, model)
    assert not path.exists() and not list(tmp_path.glob("*.tmp"))  # nothing stored, no temporary file left
    monkeypatch.setattr(jc, "_replay", real)
    jc.save(path, KEY, model)
    got = jc.load(path, KEY)
    assert got is not None and got[0].captured((4,))


def test_restored_graphs_run_only_on_buffers_their_entry_holds(tmp_path: Path) -> None:
    model = Toy()
    model.compile((2,))
    stored = jc.save(tmp_path / "toy.jit", KEY, model)
    got = jc.load(tmp_path / "toy.jit", KEY)
    assert got is not None
    jit = got[0].jits[(2,)].captured
    jc._check_identities([jit], got[1], None)  # the restore's own check passed; again by hand:
    assert {id(u) for u in got[1].uops.values()}.isdisjoint({id(u) for u in stored.uops.values()})
    with pytest.raises(jf.CacheEntryInvalid, match="does not hold"):
        jc._check_identities([jit], jc.Stored(), None)  # the same graph, checked against an entry holding nothing
    with pytest.raises(jf.CacheEntryInvalid, match="does not hold"):
        jc._check_identities([model.jits[(2,)].captured], got[1], None)  # the builder's graph: other buffers


class _Refused(Exception):
    pass


@pytest.mark.parametrize("kind", ["embedding", "generate"])
def test_the_artifact_is_checked_before_anything_cached_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             kind: str) -> None:
    monkeypatch.setenv(jf.ENV, str(tmp_path / "jit"))
    opened: list[Path] = []
    monkeypatch.setattr(wc, "load", lambda path, *a: opened.append(path))

    def verify() -> None:
        raise _Refused("sha256 mismatch")

    with pytest.raises(_Refused):
        if kind == "embedding":
            path = write_tiny_bert(tmp_path / "model")
            _loaders.load_bert(kind, path, TINY, {"max_tokens": 32}, "00" * 32, verify, lambda k: None)
        else:
            _loaders.load_llama(tmp_path / "none.gguf", {}, "00" * 32, verify, lambda k: None)
    assert opened == []
