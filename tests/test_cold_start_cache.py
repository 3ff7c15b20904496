"""The captured-JIT cache (worker/_jitcache.py): keying, corruption detection, and the real MiniLM worker's
warm-cache start and rebuild after corruption."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import sqlite3
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.reference_llama import gguf_path
from trio_gpuworker import LaneConfig, ModelConfig, Supervisor, SupervisorConfig
from trio_gpuworker.worker import _jitcache as jc
from trio_gpuworker.worker import _kernelcache as kc

REPO = Path(__file__).resolve().parent.parent
SOURCES = [Path(jc.__file__)]


def key(**extra: object) -> dict[str, object]:
    return jc.cache_key("ab" * 32, "CPU", SOURCES, {"shapes": [(16, 1)], **extra})


def state() -> dict[str, object]:
    return {"weights": np.arange(5000, dtype=np.float32), "bias": np.ones(3), "name": "m"}


def test_round_trip_with_out_of_band_buffers(tmp_path: Path) -> None:
    k = key()
    path = jc.entry_path(tmp_path, k)
    written = jc.save(path, k, state())
    assert path.stat().st_size == written
    got = jc.load(path, k)
    np.testing.assert_array_equal(got["weights"], state()["weights"])
    assert got["name"] == "m" and not list(tmp_path.glob("*.tmp"))  # the temporary file was renamed


def test_key_separates_model_device_and_versions(tmp_path: Path) -> None:
    base = key()
    variants = [jc.cache_key("cd" * 32, "CPU", SOURCES, {"shapes": [(16, 1)]}),
                jc.cache_key("ab" * 32, "CUDA", SOURCES, {"shapes": [(16, 1)]}),
                {**base, "tinygrad": "0.0.1"}, {**base, "python": "3.0.0"}, key(shapes=[(32, 1)])]
    names = {jc.entry_path(tmp_path, k) for k in [base, *variants]}
    assert len(names) == len(variants) + 1
    assert base["tinygrad"] == importlib.metadata.version("tinygrad") and base["host"]
    # an entry read back under another key is refused even when the file name were to collide
    path = jc.entry_path(tmp_path, base)
    jc.save(path, base, state())
    with pytest.raises(jc.CacheEntryInvalid, match="different key"):
        jc.load(path, {**base, "tinygrad": "0.0.1"})


def test_an_entry_others_can_write_is_refused(tmp_path: Path) -> None:
    k = key()
    path = jc.entry_path(tmp_path / "jit", k)
    jc.save(path, k, state())
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    path.chmod(0o666)
    with pytest.raises(jc.CacheEntryInvalid, match="not ours alone"):
        jc.load(path, k)


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "bad_magic", "empty", "bad_header"])
def test_corrupt_entries_are_detected(tmp_path: Path, damage: str) -> None:
    k = key()
    path = jc.entry_path(tmp_path, k)
    jc.save(path, k, state())
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":  # a byte of the out-of-band weights
        data[data.find(np.float32(4321).tobytes())] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) - 4096]
    elif damage == "bad_magic":
        data[0:2] = b"XX"
    elif damage == "empty":
        data = bytearray()
    else:
        start = len(jc.MAGIC) + 8
        data[start : start + 1] = b"["
    path.write_bytes(bytes(data))
    with pytest.raises(jc.CacheEntryInvalid):
        jc.load(path, k)


def test_load_or_build_discards_a_bad_entry_and_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(jc.ENV, str(tmp_path))
    k, logs, built = key(), [], []

    def build() -> dict[str, object]:
        built.append(1)
        return state()

    def probe(s: dict[str, object]) -> np.ndarray:
        return np.asarray(s["weights"])[:10]

    assert jc.load_or_build(k, build, probe, logs.append)[1] == "miss"
    assert jc.load_or_build(k, build, probe, logs.append)[1] == "hit" and len(built) == 1
    path = jc.entry_path(tmp_path, k)
    # a payload that hashes right but restores a model whose output differs from the stored reference
    model, _ = jc.load(path, k)
    jc.save(path, k, (model, np.zeros(10)))
    got, outcome = jc.load_or_build(k, build, probe, logs.append)
    assert outcome == "rebuilt" and len(built) == 2 and "output differs" in logs[-1]
    np.testing.assert_array_equal(got["weights"], state()["weights"])
    assert jc.load_or_build(k, build, probe, logs.append)[1] == "hit"  # the rebuilt entry was stored
    monkeypatch.delenv(jc.ENV)
    assert jc.load_or_build(k, build, probe, logs.append)[1] == "off"


def test_entries_from_other_software_for_the_same_model_are_evicted(tmp_path: Path) -> None:
    mine = key(kind="embedding")
    old_tinygrad = {**mine, "tinygrad": "0.0.1"}
    other_model = {**old_tinygrad, "artifact_sha256": "cd" * 32}
    other_shapes = key(kind="embedding", shapes=[(32, 1)])  # the same software: another lane's entry
    for k in (mine, old_tinygrad, other_model, other_shapes):
        jc.save(jc.entry_path(tmp_path, k), k, state())
    assert jc.evict_stale(tmp_path, mine) == [jc.entry_path(tmp_path, old_tinygrad)]
    assert {p.name for p in tmp_path.glob("*.jit")} == {jc.entry_path(tmp_path, k).name
                                                         for k in (mine, other_model, other_shapes)}


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
        reply = await sup.lanes["gen"].call("GENERATE", {"model_ref": "m", "max_tokens": 8}, PROMPT.tobytes())
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
    tokens; a flipped byte is detected and the entry rebuilt. Encoders are always built (worker/_loaders.py)."""
    jit_dir = tmp_path / "jit"
    cfg = SupervisorConfig(
        lanes=(LaneConfig("gen", ("m",), env={jc.ENV: str(jit_dir)}),),
        models=(ModelConfig("m", gguf_path(), kind="generate", format="gguf"),),
        state_dir=REPO / ".state",  # shares the compiled-kernel cache; the JIT cache is this test's own
        runtime_dir=Path(tempfile.mkdtemp(prefix="gw-jit-")))
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
