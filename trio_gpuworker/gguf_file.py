"""Read a GGUF file with the standard library (metadata) and numpy (tensor views, nothing dequantised).

The daemon needs the tokenizer and chat template without importing tinygrad or a GGUF package; the metadata is
a small prefix of the file, so a plain sequential parse over a read-only mapping is enough. The worker's fused
decoder reads the tensor directory the same way and views each tensor's raw blocks in a memmap of the file.
"""

from __future__ import annotations

import mmap
import pathlib
import struct
from typing import Any, NamedTuple

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
# GGUF value type id -> struct format (little-endian); 8 is a string and 9 an array.
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32

# GGML tensor types this project reads (models/quant.py dequantises every one), and each one's block:
# (elements, bytes).
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
BLOCKS: dict[int, tuple[int, int]] = {
    F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24),
    Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
}
# Every GGML type's name (ggml.h's ggml_type), for the message that refuses one this project does not read.
TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K",
    12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}


def type_name(typ: int) -> str:
    return TYPE_NAMES.get(typ, f"GGML type {typ}")


class GGUFFormatError(ValueError):
    pass


class GGUFTensor(NamedTuple):
    """One tensor's raw bytes: its GGML type, its shape outermost first, a read-only view of its blocks."""

    typ: int
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFFormatError("GGUF header runs past the end of the file")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return str(self.take(self.unpack("<Q")), "utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.unpack("<I"), self.unpack("<Q")
            if itype in _SCALARS:
                # One bulk unpack: the token-type array has ~50k entries.
                fmt = _SCALARS[itype]
                return list(struct.unpack(f"<{n}{fmt[1]}", self.take(n * struct.calcsize(fmt))))
            return [self.value(itype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise GGUFFormatError(f"unknown GGUF value type {vtype}")
        return self.unpack(_SCALARS[vtype])

    def metadata(self, path: str | pathlib.Path) -> tuple[dict[str, Any], int]:
        """(metadata with GGUF.version / GGUF.tensor_count, tensor count); leaves the cursor at the tensor infos."""
        if bytes(self.take(4)) != _MAGIC:
            raise GGUFFormatError(f"{path} is not a GGUF file")
        version = self.unpack("<I")
        if version not in _VERSIONS:
            raise GGUFFormatError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = self.unpack("<Q"), self.unpack("<Q")
        meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors}
        for _ in range(n_kv):
            key = self.string()
            meta[key] = self.value(self.unpack("<I"))
        return meta, n_tensors


_Info = tuple[str, tuple[int, ...], int, int]  # name, shape outermost first, GGML type, data offset


def _parse(path: str | pathlib.Path, tensors: bool) -> tuple[dict[str, Any], list[_Info], int]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        cur = _Cursor(memoryview(mm))
        try:
            meta, n = cur.metadata(path)
            infos = []
            if tensors:
                for _ in range(n):
                    name = cur.string()
                    dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
                    infos.append((name, tuple(reversed(dims)), cur.unpack("<I"), cur.unpack("<Q")))
            return meta, infos, cur.pos
        finally:
            # Views into the mmap must be gone before it closes.
            cur.buf.release()


def read_metadata(path: str | pathlib.Path) -> dict[str, Any]:
    """All metadata key/values of the GGUF at `path`, plus GGUF.version / GGUF.tensor_count."""
    return _parse(path, tensors=False)[0]


def read_tensors(path: str | pathlib.Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """(metadata, name -> GGUFTensor) without dequantising anything: every tensor views one memmap of the file."""
    meta, infos, end = _parse(path, tensors=True)
    align = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-end // align) * align
    data = np.memmap(path, np.uint8, "r", offset=start).view(np.ndarray)
    out: dict[str, GGUFTensor] = {}
    for name, shape, typ, off in infos:
        if typ not in BLOCKS:
            supported = ", ".join(type_name(t) for t in BLOCKS)
            raise GGUFFormatError(f"{name}: tensor type {type_name(typ)} (GGML type {typ}) is not supported; "
                                  f"supported: {supported}")
        el, nb = BLOCKS[typ]
        if shape and shape[-1] % el:
            raise GGUFFormatError(f"{name}: rows of {shape[-1]} are not whole {type_name(typ)} blocks of {el}")
        size = int(np.prod(shape)) // el * nb
        if off + size > len(data):
            raise GGUFFormatError(f"{name}: data runs past the end of {path}")
        out[name] = GGUFTensor(typ, shape, data[off : off + size])
    return meta, out


_CONTROL = 3  # llama.cpp token type
_END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


_END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def end_of_generation_ids(meta: dict[str, Any]) -> set[int]:
    """Like llama.cpp's end-of-generation set: the declared EOS, end-of-turn and end-of-message tokens, plus control
    tokens that end a turn."""
    out = {int(v) for k in _END_KEYS if isinstance(v := meta.get(k), int)}
    types = meta.get("tokenizer.ggml.token_type") or []
    for i, t in enumerate(meta.get("tokenizer.ggml.tokens") or []):
        if t in _END_MARKERS and i < len(types) and types[i] == _CONTROL:
            out.add(i)
    return out
