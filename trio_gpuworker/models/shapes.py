"""The encoder's micro-batch shapes: length buckets, batch sizes, the batch plan and the shapes a BEAM search
tunes. Pure Python (no tinygrad), so the daemon and `gpuworkerctl tune` can name the shapes a worker will use."""

from __future__ import annotations

from collections.abc import Sequence

# Few sequence lengths and batch sizes, so the kernel cache and TinyJit see few shapes.
LENGTH_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
# A full micro-batch's tokens: 16 x 32, 32 x 16, 64 x 8, ... The encoder's dense kernels (most of the time)
# depend on the token count alone, so full micro-batches of every length share them, BEAM-tuned ones too.
MAX_BATCH_TOKENS = 512
# BEAM searches full micro-batches up to this length by default: each searched shape costs minutes, once.
TUNED_MAX_LENGTH = 128
# A tuned shape runs ~3x faster than tinygrad's hand-coded kernels on this kind of CPU: a remainder of a
# third of a tuned batch or more is padded up to it.
TUNED_PAD = 3


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


def plan_rows(lengths: Sequence[int], buckets: Sequence[int], sizes: Sequence[int],
              tuned: dict[int, int]) -> list[tuple[int, int, list[int]]]:
    """The micro-batches of rows with these token counts (each at most the last bucket): (padded length, batch size,
    the rows' indices). Rows go longest first: a micro-batch is planned for the rows of the longest bucket left, and
    the slots it would pad are filled with the next (shorter) rows instead, so short rows ride in a longer bucket's
    (often BEAM-tuned) batch rather than in small batches of their own. ``tuned`` maps a length to its largest
    BEAM-tuned batch size."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bucket = [next(b for b in buckets if b >= lengths[i]) for i in order]
    out, done = [], 0
    while done < len(order):
        L = bucket[done]
        _, B = plan_batches(bucket[done:].count(L), sizes_for(L, sizes), tuned.get(L))[0]
        take = min(B, len(order) - done)
        out.append((L, B, order[done : done + take]))
        done += take
    return out


def plan_batches(n: int, sizes: Sequence[int], tuned: int | None = None) -> list[tuple[int, int]]:
    """Splits n rows into (real_rows, padded_batch) micro-batches using only ``sizes``.

    Pads up to the next size when that wastes at most half the real rows, else takes the largest size that fits.
    ``tuned`` names a BEAM-tuned batch size, worth padding up to from a third of it (TUNED_PAD).
    """
    out: list[tuple[int, int]] = []
    while n > 0:
        down = max((s for s in sizes if s <= n), default=min(sizes))
        up = min((s for s in sizes if s >= n), default=down)
        if tuned is not None and n <= tuned <= TUNED_PAD * n:
            take, pad = n, tuned
        else:
            take, pad = (n, up) if n <= up and up - n <= n / 2 else (min(down, n), down)
        out.append((take, pad))
        n -= take
    return out
