"""C kernel sources from the package's `kernels/` folder, ready for one compiler call on stdin.

tinygrad compiles a kernel from one source string, so `#include "x.h"` lines are expanded here, each file
behind a `#line` marker: a compiler error or warning names the real file and line. A header without an
include guard is a template and is expanded at every include (qmatmul.h). The `#define`s a kernel needs
come from frozen dataclasses (`defines`), never from strings written by hand. Pure Python: the ctypes tests
build the very same source.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

KERNELS = resources.files(__package__) / "kernels"
KERNELS_LABEL = "trio_gpuworker/models/kernels"  # what #line markers call the package's kernel folder
_INCLUDE = re.compile(r'\s*#\s*include\s+"([^"]+)"\s*$')
_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_MAX_DEPTH = 16


def defines(*specs: Any) -> str:
    """`#define FIELD value` for every field of each frozen dataclass, its name upper-cased: ints as C ints,
    floats as C double literals that round-trip exactly (repr)."""
    out = []
    for spec in specs:
        if not dataclasses.is_dataclass(spec) or isinstance(spec, type) or not spec.__dataclass_params__.frozen:
            raise TypeError(f"kernel defines come from frozen dataclass instances, not {type(spec).__name__}")
        for f in dataclasses.fields(spec):
            name, value = f.name.upper(), getattr(spec, f.name)
            if not _NAME.fullmatch(name):
                raise ValueError(f"{f.name!r} is not a C macro name")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"define {name} must be an int or float, got {value!r}")
            out.append(f"#define {name} {value!r}\n")
    return "".join(out)


def _label(res: Traversable, root: Traversable) -> str:
    """The name a #line marker gives a file: its path inside the package, as in the source tree."""
    return f"{KERNELS_LABEL}/{res.name}" if root == KERNELS else str(res)


def _expand(res: Traversable, root: Traversable, dirs: tuple[Traversable, ...], depth: int) -> str:
    if depth > _MAX_DEPTH:
        raise ValueError(f"{res.name}: includes nest deeper than {_MAX_DEPTH}")
    label = _label(res, root)
    out = [f'#line 1 "{label}"\n']
    for no, line in enumerate(res.read_text().splitlines(), start=1):
        if (m := _INCLUDE.match(line)) is None:
            out.append(line + "\n")
            continue
        sub, sub_root = _find(m.group(1), dirs, f"{label}:{no}")
        out.append(_expand(sub, sub_root, dirs, depth + 1))
        out.append(f'#line {no + 1} "{label}"\n')
    return "".join(out)


def _find(name: str, dirs: tuple[Traversable, ...], where: str) -> tuple[Traversable, Traversable]:
    for d in dirs:
        if (res := d / name).is_file():
            return res, d
    raise FileNotFoundError(f"{where}: no kernel file {name!r} in {', '.join(str(d) for d in dirs)}")


def source(name: str, *specs: Any, dirs: tuple[Traversable, ...] = ()) -> str:
    """The defines of `specs`, then kernel file `name` with its includes expanded. `dirs` are searched before
    the package's kernels (a test's own entry points)."""
    search = (*dirs, KERNELS)
    res, root = _find(name, search, "kernel")
    return defines(*specs) + _expand(res, root, search, 0)


def digest() -> str:
    """sha256 of every kernel file in the package: what a cache of compiled kernels must be keyed by."""
    h = hashlib.sha256()
    for res in sorted((r for r in KERNELS.iterdir() if r.is_file()), key=lambda r: r.name):
        h.update(res.name.encode() + b"\0" + res.read_bytes())
    return h.hexdigest()
