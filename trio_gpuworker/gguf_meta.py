"""Read the key/value metadata of a GGUF file (not its tensors) with the standard library only.

The daemon needs the tokenizer and chat template without importing tinygrad or a GGUF package, and the
metadata is a small prefix of the file, so a plain sequential parse is enough.
"""

from __future__ import annotations

import mmap
import pathlib
import struct
from typing import Any

_MAGIC = b"GGUF"
# GGUF value type id -> struct format (little-endian); 8 is a string and 9 an array.
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFFormatError("GGUF metadata runs past the end of the file")
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


def read_metadata(path: str | pathlib.Path) -> dict[str, Any]:
    """All metadata key/values of the GGUF at `path`, plus GGUF.version / GGUF.tensor_count."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        cur = _Cursor(memoryview(mm))
        try:
            if bytes(cur.take(4)) != _MAGIC:
                raise GGUFFormatError(f"{path} is not a GGUF file")
            version = cur.unpack("<I")
            if version not in (2, 3):
                raise GGUFFormatError(f"unsupported GGUF version {version}")
            n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
            meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors}
            for _ in range(n_kv):
                key = cur.string()
                meta[key] = cur.value(cur.unpack("<I"))
            return meta
        finally:
            # Views into the mmap must be gone before it closes.
            cur.buf.release()


_CONTROL = 3  # llama.cpp token type
_END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


def end_of_generation_ids(meta: dict[str, Any]) -> set[int]:
    """Like llama.cpp's end-of-generation set: the declared EOS plus control tokens that end a turn."""
    eos = meta.get("tokenizer.ggml.eos_token_id")
    out = {int(eos)} if isinstance(eos, int) else set()
    types = meta.get("tokenizer.ggml.token_type") or []
    for i, t in enumerate(meta.get("tokenizer.ggml.tokens") or []):
        if t in _END_MARKERS and i < len(types) and types[i] == _CONTROL:
            out.add(i)
    return out
