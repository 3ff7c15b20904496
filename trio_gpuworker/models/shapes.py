"""The encoder's micro-batch shapes: length buckets, batch sizes, the batch plan and the shapes a BEAM search
tunes. Pure Python (no tinygrad), so the daemon and `gpuworkerctl tune` can name the shapes a worker will use."""

from __future__ import annotations

from collections.abc import Sequence

# Few sequence lengths and batch sizes, so the kernel cache and TinyJit see few shapes.
LENGTH_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
BATCH_SIZES: tuple[int, ...] = (1, 4, 8, 16, 32)
# Caps a micro-batch's tokens: bounds attention memory and keeps PROGRESS frequent on slow CPUs.
MAX_BATCH_TOKENS = 4096
# BEAM searches only shapes up to this length by default: each searched shape costs minutes, once.
TUNED_MAX_LENGTH = 64


def buckets(max_tokens: int) -> tuple[int, ...]:
    """The padded lengths of a model truncating at `max_tokens`."""
    return (*(b for b in LENGTH_BUCKETS if b < max_tokens), max_tokens)


def sizes_for(length: int, sizes: Sequence[int] = BATCH_SIZES) -> tuple[int, ...]:
    """The batch sizes a micro-batch of padded length `length` may have."""
    return tuple(s for s in sizes if s * length <= MAX_BATCH_TOKENS) or tuple(sizes[:1])


def tuned_shapes(max_tokens: int, sizes: Sequence[int] = BATCH_SIZES) -> list[tuple[int, int]]:
    """The (length, batch) shapes worth a BEAM search: full micro-batches of the short buckets most traffic
    lands in."""
    return [(L, max(sizes_for(L, sizes))) for L in buckets(max_tokens) if L <= TUNED_MAX_LENGTH]


def plan_batches(n: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Splits n rows into (real_rows, padded_batch) micro-batches using only ``sizes``.

    Pads up to the next size when that wastes at most half the real rows, else takes the largest size that fits.
    """
    out: list[tuple[int, int]] = []
    while n > 0:
        down = max((s for s in sizes if s <= n), default=min(sizes))
        up = min((s for s in sizes if s >= n), default=down)
        take, pad = (n, up) if n <= up and up - n <= n / 2 else (min(down, n), down)
        out.append((take, pad))
        n -= take
    return out
