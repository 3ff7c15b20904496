"""What a pickled TinyJit loses and costs to recompute on its first replay.

CapturedJit pickles its program, not its cached `_written_uops` (the buffers the program writes, found by
a graph walk): recomputing that costs ~0.1 s for MiniLM and ~0.9 s for SmolLM2 on the first call after a
restore. Models store it next to their JITs and put it back (worker/_jitcache.py pickles the models).
"""

from __future__ import annotations

from typing import Any


def written_sets(jits: dict[Any, Any]) -> dict[Any, Any]:
    return {k: j.captured._written_uops for k, j in jits.items() if getattr(j, "captured", None) is not None}


def restore_written_sets(jits: dict[Any, Any], written: dict[Any, Any]) -> None:
    for k, w in written.items():
        if (captured := getattr(jits.get(k), "captured", None)) is not None:
            captured.__dict__["_written_uops"] = w  # where functools.cached_property keeps its value
