"""The captured-JIT cache (worker/_jitfile.py, _jitcache.py, _warmcache.py): keying, corruption detection, locks,
eviction, the artifact check before anything cached runs, the writer's probe, and the real SmolLM2 worker's warm-cache
start and rebuild after corruption."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import multiprocessing
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from tests.support.config import REAL_WORKER, supervisor_config
from tests.support.reference_llama import gguf_path
from tests.support.state import SESSION_STATE, short_dir
from trio_gpuworker import LaneConfig, ModelConfig, Supervisor, SupervisorConfig
from trio_gpuworker._proto import Generate
from trio_gpuworker.worker import _jitcache as jc
from trio_gpuworker.worker import _jitfile as jf
from trio_gpuworker.worker import _kernelcache as kc
from trio_gpuworker.worker import _warmcache as wc

SOURCES = [Path(jc.__file__)]


def key(**extra: object) -> dict[str, object]:
    return jf.cache_key("ab" * 32, "CPU", SOURCES, {"shapes": [(16, 1)], **extra})


def state() -> dict[str, object]:
    return {"weights": np.arange(5000, dtype=np.float32), "bias": np.ones(3), "name": "m"}


def restored(path: Path, k: dict[str, object]) -> dict[str, object]:
    got = jc.load(path, k)
    assert got is not None
    return got[0]


def test_round_trip_with_out_of_band_buffers(tmp_path: Path) -> None:
    k = key()
    path = jf.entry_path(tmp_path, k)
    jc.save(path, k, state())
    got = restored(path, k)
    np.testing.assert_array_equal(got["weights"], state()["weights"])
    assert got["name"] == "m" and not list(tmp_path.glob("*.tmp"))  # the temporary file was renamed
    assert jf.read_key(path) == json.loads(json.dumps(k))


def test_key_separates_model_device_and_versions(tmp_path: Path) -> None:
    base = key()
    variants = [jf.cache_key("cd" * 32, "CPU", SOURCES, {"shapes": [(16, 1)]}),
                jf.cache_key("ab" * 32, "CUDA", SOURCES, {"shapes": [(16, 1)]}),
                {**base, "tinygrad": "0.0.1"}, {**base, "python": "3.0.0"}, key(shapes=[(32, 1)])]
    names = {jf.entry_path(tmp_path, k) for k in [base, *variants]}
    assert len(names) == len(variants) + 1
    assert base["tinygrad"] == importlib.metadata.version("tinygrad") and base["host"]
    # an entry read back under another key is refused even when the file name were to collide
    path = jf.entry_path(tmp_path, base)
    jc.save(path, base, state())
    with pytest.raises(jf.CacheEntryInvalid, match="different key"):
        jc.load(path, {**base, "tinygrad": "0.0.1"})


def test_an_entry_others_can_write_is_refused(tmp_path: Path) -> None:
    k = key()
    path = jf.entry_path(tmp_path / "jit", k)
    jc.save(path, k, state())
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    path.chmod(0o666)
    with pytest.raises(jf.CacheEntryInvalid, match="not ours alone"):
        jc.load(path, k)


def _header_span(data: bytes) -> tuple[int, int]:
    offset, length = jf._HEAD.unpack(data[len(jf.MAGIC) : len(jf.MAGIC) + jf._HEAD.size])
    return offset, length


@pytest.mark.parametrize("damage", ["flip_payload", "flip_pickle", "truncate", "bad_magic", "empty", "bad_header",
                                    "foreign_part"])
def test_corrupt_entries_are_detected(tmp_path: Path, damage: str) -> None:
    k = key()
    path = jf.entry_path(tmp_path, k)
    jc.save(path, k, state())
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":  # a byte of the out-of-band weights
        data[data.find(np.float32(4321).tobytes())] ^= 0xFF
    elif damage == "flip_pickle":
        data[jf.PAGE + 20] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) - 4096]
    elif damage == "bad_magic":
        data[0:2] = b"XX"
    elif damage == "empty":
        data = bytearray()
    elif damage == "bad_header":
        offset, _ = _header_span(bytes(data))
        data[offset : offset + 1] = b"["
    else:  # a part names the entry it extends: restored against another one, it is refused
        with pytest.raises(jf.CacheEntryInvalid, match="another entry"):
            jc.load(path, k, jc.Stored("cd" * 32))
        return
    path.write_bytes(bytes(data))
    with pytest.raises(jf.CacheEntryInvalid):
        jc.load(path, k)


def test_load_or_build_discards_a_bad_entry_and_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(jf.ENV, str(tmp_path))
    k, logs, built = key(), [], []

    def build() -> dict[str, object]:
        built.append(1)
        return state()

    assert wc.load_or_build(k, build, logs.append)[2] == "miss"
    model, stored, outcome = wc.load_or_build(k, build, logs.append)
    assert outcome == "hit" and len(built) == 1 and stored is not None
    np.testing.assert_array_equal(model["weights"], state()["weights"])
    path = jf.entry_path(tmp_path, k)
    data = bytearray(path.read_bytes())
    data[data.find(np.float32(4321).tobytes())] ^= 0xFF
    path.write_bytes(bytes(data))
    got, _, outcome = wc.load_or_build(k, build, logs.append)
    assert outcome == "rebuilt" and len(built) == 2 and "sha256 mismatch" in logs[-1]
    np.testing.assert_array_equal(got["weights"], state()["weights"])
    assert wc.load_or_build(k, build, logs.append)[2] == "hit"  # the rebuilt entry was stored
    monkeypatch.delenv(jf.ENV)
    assert wc.load_or_build(k, build, logs.append)[2] == "off"


def test_entries_from_other_software_for_the_same_model_are_evicted(tmp_path: Path) -> None:
    mine = key(kind="embedding")
    old_tinygrad = {**mine, "tinygrad": "0.0.1"}
    other_model = {**old_tinygrad, "artifact_sha256": "cd" * 32}
    other_shapes = key(kind="embedding", shapes=[(32, 1)])  # the same software: another lane's entry
    old_part = {**old_tinygrad, "part": [16, 1]}
    for k in (mine, old_tinygrad, other_model, other_shapes, old_part):
        jc.save(jf.entry_path(tmp_path, k), k, state())
    assert set(jf.evict_stale(tmp_path, mine)) == {jf.entry_path(tmp_path, k) for k in (old_tinygrad, old_part)}
    assert {p.name for p in tmp_path.glob("*.jit")} == {jf.entry_path(tmp_path, k).name
                                                         for k in (mine, other_model, other_shapes)}


def _hold(path: str, name: str, held: object, release: object) -> None:
    locks = jf.Locks(Path(path))
    assert locks.try_take(name)
    held.set()  # type: ignore[attr-defined]
    release.wait(30)  # type: ignore[attr-defined]


def test_locks_exclude_other_processes_per_name(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold, args=(str(tmp_path / "locks"), "a", held, release))
    other.start()
    try:
        assert held.wait(60)
        locks = jf.Locks(tmp_path / "locks")
        assert not locks.try_take("a") and locks.try_take("b")  # one byte per name
        locks.release("b")
        with locks.held("a", wait_s=0.2) as got:
            assert not got  # the other process still holds it: the wait is bounded
        release.set()
        other.join(30)
        with locks.held("a", wait_s=5) as got:
            assert got  # released when the holder exited
    finally:
        release.set()
        other.join(30)


def test_kernel_cache_is_moved_aside_when_corrupt_or_from_another_host(tmp_path: Path) -> None:
    db = tmp_path / "tinygrad.db"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("CREATE TABLE t (k text, v blob)")
        conn.commit()
    assert kc.check_kernel_cache(db) is None and db.exists()  # adopted; the stamp is written
    assert (tmp_path / "tinygrad.db.stamp").read_text() == kc.host_key()
    db.write_bytes(b"not a database" * 512)
    assert "corrupt" in (kc.check_kernel_cache(db) or "") and not db.exists()
    assert (tmp_path / "tinygrad.db.bad").exists()
    db.write_bytes(b"")  # an empty file is a valid empty database
    (tmp_path / "tinygrad.db.stamp").write_text("tinygrad 0.0.1 x86_64:0")
    assert "built for" in (kc.check_kernel_cache(db) or "") and not db.exists()
    assert (tmp_path / "tinygrad.db.stamp").read_text() == kc.host_key()


PROMPT = np.array([1, 9690, 42, 253, 2024, 30, 2], dtype=np.int32)


async def start_and_generate(cfg: SupervisorConfig) -> tuple[np.ndarray, str]:
    async with Supervisor(cfg) as sup:
        reply = await sup.lanes["gen"].call(Generate(model_ref="m", max_tokens=8, raw=PROMPT.tobytes()))
        return np.frombuffer(reply.raw or b"", dtype="<i4").copy(), sup.lanes["gen"].log.tail(4096)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.slow
async def test_warm_cache_start_and_corruption_rebuild(tmp_path: Path) -> None:
    """The real SmolLM2 worker (fused decoder): a warm start restores the captured graphs and generates the same
    tokens; a flipped byte is detected and the entry rebuilt."""
    jit_dir = tmp_path / "jit"
    cfg = supervisor_config(
        tmp_path, lanes=(LaneConfig("gen", ("m",), env={jf.ENV: str(jit_dir)}),),
        models=(ModelConfig("m", gguf_path(), kind="generate", format="gguf"),),
        state_dir=SESSION_STATE,  # shares the session's compiled-kernel cache; the JIT cache is this test's own
        runtime_dir=short_dir("gw-jit-"), **REAL_WORKER)
    cold, log = await start_and_generate(cfg)
    assert "jit cache miss" in log and len(cold) == 8
    (entry,) = jit_dir.glob("*.jit")
    warm, log = await start_and_generate(cfg)
    assert "jit cache hit" in log
    np.testing.assert_array_equal(warm, cold)  # the restored model generates the same tokens
    # one flipped byte in the stored weights: detected, discarded, rebuilt, and the answer is still right
    flip_byte(entry, entry.stat().st_size // 2)
    rebuilt, log = await start_and_generate(cfg)
    assert "sha256 mismatch" in log and "jit cache rebuilt" in log
    np.testing.assert_array_equal(rebuilt, cold)
    again, log = await start_and_generate(cfg)
    assert "jit cache hit" in log  # the rebuilt entry was stored whole
    np.testing.assert_array_equal(again, cold)
