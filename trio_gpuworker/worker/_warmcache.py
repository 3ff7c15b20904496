"""How LOAD and serving use the JIT cache (worker/_jitcache.py): a whole model per entry, or an encoder's weights with
one part per micro-batch shape.

A decoder runs two graphs (prefill and decode), so its entry holds the whole warmed model. An encoder runs one graph
per micro-batch shape, ~20 of them, and a first worker serves long before it has seen most: its entry holds the
weights, and each shape's captured graph is a part of that entry, stored as soon as it is compiled. Every entry and
every part is built once per machine: a worker takes its lock (worker/_jitfile.py Locks) before it builds it and
looks again once it holds it; one that finds another worker building waits for it, then restores what it stored.
Writes are a temporary file and a rename, and parts are separate files, so replicas writing at once lose nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ._jitcache import Stored, load, save
from ._jitfile import CacheEntryInvalid, Locks, cache_dir_from_env, discard, entry_path, evict_stale

LOCK_WAIT_S = 300.0  # a LOAD waits this long for another worker's build: one BEAM-searched shape takes minutes
REQUEST_WAIT_S = 60.0  # a request waits this long for another worker compiling a shape it needs
LOCKS = "locks"

Shape = tuple[int, int]
Log = Callable[[str], None]


class ShapedModel(Protocol):
    """What an encoder offers the cache: a captured TinyJit per shape, which the cache may put in."""

    jits: dict[Shape, Any]

    def captured(self, shape: Shape) -> bool: ...

    def shapes_for(self, lengths: Sequence[int]) -> list[Shape]: ...


def _store(path: Path, key: dict[str, Any], state: Any, base: Stored | None, log: Log) -> Stored | None:
    try:
        stored = save(path, key, state, base)
    except Exception as exc:  # disk, pickling or the writer's probe: a cache costs only speed
        log(f"jit cache: cannot store {path.name}: {type(exc).__name__}: {exc}")
        return None
    for stale in evict_stale(path.parent, key):
        log(f"jit cache: removed {stale.name}, written by other software for this model")
    return stored


def _restore(path: Path, key: dict[str, Any], base: Stored | None, log: Log) -> tuple[Any, Stored] | None:
    try:
        return load(path, key, base)
    except CacheEntryInvalid as exc:
        log(f"jit cache: discarding {path.name}: {exc}")
        discard(path)
        return None


def load_or_build(key: dict[str, Any], build: Callable[[], Any], log: Log) -> tuple[Any, Stored | None, str]:
    """(model, what this process holds of its entry, outcome): restored from the cache ("hit"), or built and stored
    ("miss", or "rebuilt" after a bad entry was discarded; "off" without a cache directory). Replicas starting
    together build once: the others wait for the builder's entry and restore it ("waited": a first start too)."""
    cache_dir = cache_dir_from_env()
    if cache_dir is None:
        return build(), None, "off"
    path = entry_path(cache_dir, key)
    bad = path.exists()
    if (got := _restore(path, key, None, log)) is not None:
        return got[0], got[1], "hit"
    with Locks(cache_dir / LOCKS).held(path.name, LOCK_WAIT_S):
        if (got := _restore(path, key, None, log)) is not None:  # another worker built it meanwhile
            return got[0], got[1], "waited"
        model = build()
        stored = _store(path, key, model, None, log)
        if hasattr(model, "forget_prompts"):  # a decoder: the store's probe replayed its graphs over its cache
            model.forget_prompts()
        return model, stored, "rebuilt" if bad else "miss"


class ShapeCache:
    """An encoder's per-shape graphs as parts of its entry (`base`): restored when stored, else compiled by
    `compile(shape)` (which captures the model's JIT for it) and stored for every later worker."""

    def __init__(self, cache_dir: Path, key: dict[str, Any], base: Stored, beams: dict[Shape, int],
                 compile: Callable[[Shape], None], log: Log) -> None:
        self.cache_dir, self.key, self.base, self.beams = cache_dir, key, base, beams
        self.compile, self.log = compile, log
        self.locks = Locks(cache_dir / LOCKS)
        self.counts: Counter[str] = Counter()
        self.tried: set[Shape] = set()  # compiled here once already (a graph that does not capture stays so)

    def _part(self, shape: Shape) -> tuple[Path, dict[str, Any]]:
        key = {**self.key, "part": list(shape), "part_beam": self.beams.get(shape, 0)}
        return entry_path(self.cache_dir, key), key

    def _restore(self, model: ShapedModel, shape: Shape) -> bool:
        path, key = self._part(shape)
        if (got := _restore(path, key, self.base, self.log)) is None:
            return False
        if getattr(got[0], "captured", None) is None:
            self.log(f"jit cache: discarding {path.name}: not a captured graph")
            discard(path)
            return False
        model.jits[shape] = got[0]
        self.counts["restored"] += 1
        return True

    def _build(self, model: ShapedModel, shape: Shape) -> None:
        self.tried.add(shape)
        self.compile(shape)
        self.counts["compiled"] += 1
        path, key = self._part(shape)
        if model.captured(shape):
            _store(path, key, model.jits[shape], self.base, self.log)

    def provide(self, model: ShapedModel, shape: Shape, wait_s: float) -> None:
        """The shape's graph in `model`: restored, or compiled and stored (after waiting up to `wait_s` for a worker
        compiling it already)."""
        if model.captured(shape) or shape in self.tried or self._restore(model, shape):
            return
        path, _ = self._part(shape)
        with self.locks.held(path.name, wait_s):
            if not self._restore(model, shape):  # the worker we waited for may have stored it
                self._build(model, shape)

    def provide_all(self, model: ShapedModel, shapes: Sequence[Shape], progress: Callable[[int], None]) -> None:
        """Every shape's graph, in order where other workers leave it so: a shape another worker is compiling is
        left for later (its part is restored then), so replicas loading together share the work."""
        pending, done = list(shapes), 0
        while pending:
            for shape in list(pending):
                if not model.captured(shape) and not self._restore(model, shape):
                    path, _ = self._part(shape)
                    if not self.locks.try_take(path.name):
                        continue  # another worker compiles it
                    try:
                        if not self._restore(model, shape):
                            self._build(model, shape)
                    finally:
                        self.locks.release(path.name)
                pending.remove(shape)
                done += 1
                progress(done)
            if pending:  # every one left is being compiled elsewhere: wait for the first
                self.provide(model, pending.pop(0), LOCK_WAIT_S)
                done += 1
                progress(done)

    def describe(self) -> str:
        return f"{self.counts['restored']} shape(s) restored, {self.counts['compiled']} compiled"


class GrowingEncoder:
    """An encoder served with its ShapeCache: a shape it has no graph for yet is restored or compiled (and stored)
    before the run that needs it, so each shape is compiled once per machine, not once per worker."""

    def __init__(self, impl: Any, shapes: ShapeCache) -> None:
        self.impl, self.shapes = impl, shapes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.impl, name)

    def _ready(self, rows: Sequence[Any]) -> None:
        for shape in self.impl.shapes_for([len(r) for r in rows]):
            self.shapes.provide(self.impl, shape, REQUEST_WAIT_S)

    def embed(self, rows: list[Any], *args: Any, **kwargs: Any) -> Any:
        self._ready(rows)
        return self.impl.embed(rows, *args, **kwargs)

    def logits(self, pairs: list[Any], *args: Any, **kwargs: Any) -> Any:
        self._ready(pairs)
        return self.impl.logits(pairs, *args, **kwargs)

    def score(self, pairs: list[Any], *args: Any, **kwargs: Any) -> Any:
        self._ready(pairs)
        return self.impl.score(pairs, *args, **kwargs)
