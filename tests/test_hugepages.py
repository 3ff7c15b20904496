"""The fused decoder's weights on transparent huge pages (trio_gpuworker/_hugepages.py): the mapping gets them where
the kernel's policy allows, a built model's packed weights live in such mappings, and a model restored from the JIT
cache has them copied into mappings of its own rather than left on the cache file's pages, and no record of its
cache slots' prompts."""

from __future__ import annotations

import ctypes
import mmap
import re
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402

from tests.support.tiny_gguf import write_llama  # noqa: E402
from trio_gpuworker import _hugepages  # noqa: E402
from trio_gpuworker.models.llama_fused import FusedLlamaLM  # noqa: E402
from trio_gpuworker.worker import _jitcache  # noqa: E402

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_bytes(start: int, size: int) -> int:
    """AnonHugePages of the mapping at `start` (smaps), in bytes."""
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(v, 16) for v in block.split(None, 1)[0].split("-"))
        if lo <= start < hi:
            found = re.search(r"AnonHugePages:\s+(\d+) kB", block)
            return int(found.group(1)) * 1024 if found else 0
    raise AssertionError(f"no mapping holds {start:#x}")


def _address(t: object) -> int:
    return int(t.uop.buffer._buf.va_addr)  # type: ignore[attr-defined]


def _start(mm: mmap.mmap) -> int:
    probe = ctypes.c_char.from_buffer(mm)
    at = ctypes.addressof(probe)
    del probe  # no export left behind
    return at


def _within(at: int, pages: list[mmap.mmap]) -> bool:
    return any(_start(mm) <= at < _start(mm) + len(mm) for mm in pages)


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="this kernel gives no huge pages")
def test_a_mapping_is_backed_by_huge_pages() -> None:
    mm, at = _hugepages.mapping(8 * _hugepages.HUGE_PAGE)
    np.frombuffer(mm, np.uint8)[:] = 1  # touched: the pages exist now
    assert _huge_bytes(at, len(mm)) >= _hugepages.HUGE_PAGE
    assert bytes(mm[:4]) == b"\x01" * 4


def test_a_copy_holds_the_bytes_in_a_mapping_of_its_own() -> None:
    src = np.arange(1 << 20, dtype=np.uint32)
    mm, at = _hugepages.copied(src.ctypes.data, src.nbytes)
    assert np.array_equal(np.frombuffer(mm, np.uint32, src.size), src)
    assert _start(mm) == at


def test_built_and_restored_weights_live_on_mappings_of_their_own(tmp_path: Path) -> None:
    path = write_llama(tmp_path / "k.gguf", {"attn_q": T.Q4_K, "ffn_down": T.Q6_K}, tied=True)
    lm = FusedLlamaLM.load(path, max_context=32, warmup=False)
    weights = (lm.wqkv, lm.wo, lm.wgu, lm.wd, lm.tok_embd)
    assert all(_within(_address(w), lm._pages) for w in weights)
    want, _ = lm.generate(np.array([3, 17, 101], np.int32), 4, ignore_eos=True)
    assert lm._held  # slot 0's prompt (models/llama_fused.py reused)

    key = {"test": "hugepages"}
    _jitcache.save(tmp_path / "e.jit", key, lm)
    loaded = _jitcache.load(tmp_path / "e.jit", key)
    assert loaded is not None
    twin = loaded[0]
    # this process's own state is not stored: the copies below hold the weights, and the cache's contents are unknown
    assert twin._pages == [] and twin._held == {}
    restored = (twin.wqkv, twin.wo, twin.wgu, twin.wd, twin.tok_embd)
    assert all(_within(_address(w), _jitcache._RESIDENT) for w in restored)
    got, _ = twin.generate(np.array([3, 17, 101], np.int32), 4, ignore_eos=True)
    assert got == want
