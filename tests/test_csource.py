"""models/csource.py: kernel files joined behind #line markers, defines from frozen dataclasses."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from trio_gpuworker.models import csource


@dataclass(frozen=True)
class Dims:
    d: int
    eps: float


@dataclass
class Loose:
    d: int


def test_defines_come_from_frozen_dataclasses() -> None:
    eps = 9.999999747378752e-06  # a float32 epsilon, exactly: repr round-trips it
    assert csource.defines(Dims(d=384, eps=eps)) == "#define D 384\n#define EPS 9.999999747378752e-06\n"
    with pytest.raises(TypeError, match="frozen"):
        csource.defines(Loose(d=1))
    with pytest.raises(TypeError, match="frozen"):
        csource.defines({"d": 1})
    with pytest.raises(TypeError, match="int or float"):
        csource.defines(Dims(d=True, eps=0.0))  # type: ignore[arg-type]


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "top.c").write_text('/* top */\n#include "tpl.h"\nint mid = 1;\n#include "tpl.h"\nint end = 2;\n')
    (tmp_path / "tpl.h").write_text("/* a template: no guard */\nint CAT_NAME(x);\n")
    return tmp_path


def test_includes_expand_behind_line_markers(tmp_path: Path) -> None:
    src = csource.source("top.c", dirs=(_tree(tmp_path),))
    lines = src.splitlines()
    assert lines[0] == f'#line 1 "{tmp_path / "top.c"}"'
    assert lines.count(f'#line 1 "{tmp_path / "tpl.h"}"') == 2  # a header without a guard expands every time
    assert lines[lines.index("int mid = 1;") - 1] == f'#line 3 "{tmp_path / "top.c"}"'
    assert lines[lines.index("int end = 2;") - 1] == f'#line 5 "{tmp_path / "top.c"}"'


def test_a_compile_error_names_the_real_file_and_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Through the compiler command tinygrad's CPU device runs (clang reads the source on stdin)."""
    from trio_gpuworker.models import ckernel

    tree = _tree(tmp_path)
    (tree / "tpl.h").write_text("/* fine */\nint ok;\nint broken = ;\n")
    with pytest.raises(subprocess.CalledProcessError):
        ckernel.compile_object(csource.source("top.c", dirs=(tree,)))
    assert f"{tree / 'tpl.h'}:3:14: error: expected expression" in capfd.readouterr().err


def test_package_kernels_are_labelled_by_their_path_in_the_tree() -> None:
    src = csource.source("quant.h")
    assert src.startswith('#line 1 "trio_gpuworker/models/kernels/quant.h"\n')
    assert '#line 1 "trio_gpuworker/models/kernels/vec.h"\n' in src
    root = Path(__file__).resolve().parent.parent
    assert (root / csource.KERNELS_LABEL / "quant.h").is_file()


def test_missing_files_and_include_loops_are_errors(tmp_path: Path) -> None:
    (tmp_path / "a.c").write_text('#include "nope.h"\n')
    with pytest.raises(FileNotFoundError, match=r"a.c:1: no kernel file 'nope.h'"):
        csource.source("a.c", dirs=(tmp_path,))
    (tmp_path / "loop.h").write_text('#include "loop.h"\n')
    with pytest.raises(ValueError, match="nest deeper"):
        csource.source("loop.h", dirs=(tmp_path,))


def test_digest_follows_the_kernel_files() -> None:
    assert len(csource.digest()) == 64 and csource.digest() == csource.digest()
