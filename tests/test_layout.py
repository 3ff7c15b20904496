"""The shape of the codebase: no import cycles (not even under TYPE_CHECKING), an I/O-free core, no package reaching
into another's private modules, no stack of mixins, short functions; and of its tests: shared code in
tests/support/, no test file importing another."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "trio_gpuworker"


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every package module `name` imports, wherever the import statement sits (functions, TYPE_CHECKING)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    deps: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            parts = target.split(".")
            # importing a.b.c runs a and a.b first (unless they enclose the importer itself)
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in known and dep != name and not name.startswith(dep + "."):
                    deps.add(dep)
    return deps


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            comp.append(v)
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_import_graph_has_no_cycles() -> None:
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_proto_core_does_no_io() -> None:
    """The sans-I/O core imports no trio, socket, os, threads or tinygrad, and nothing from the shell."""
    known = modules()
    banned = ("trio", "socket", "os", "threading", "tinygrad", "time", "selectors", "asyncio", "subprocess")
    for name, path in known.items():
        if not name.startswith("trio_gpuworker._proto"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            roots = [a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else \
                [(node.module or "").split(".")[0]] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not set(roots) & set(banned), f"{name} imports {roots}"
        shell = {"trio_gpuworker.supervisor", "trio_gpuworker.daemon", "trio_gpuworker.worker"}
        assert not {d.rsplit(".", 1)[0] if d.count(".") > 1 else d for d in imports(name, path, known)} & shell


def test_no_module_reaches_into_another_packages_private_modules() -> None:
    """`daemon` uses what `supervisor` re-exports, never `supervisor._admission` and the like."""
    known = modules()
    reaching = []
    for name, path in known.items():
        for dep in imports(name, path, known):
            package, _, leaf = dep.rpartition(".")
            inside = name == package or name.startswith(package + ".")
            if leaf.startswith("_") and not leaf.startswith("__") and not inside:
                reaching.append(f"{name} -> {dep}")
    assert reaching == []


def test_no_class_is_a_stack_of_mixins() -> None:
    """A class is whole or composed of objects with explicit interfaces: at most two bases (an error's place in the
    hierarchy and the builtin it also is, like InvalidRequest(GpuWorkerError, ValueError))."""
    stacked = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and len(node.bases) > 2:
                stacked.append(f"{name}.{node.name}({', '.join(ast.unparse(b) for b in node.bases)})")
    assert stacked == []


# a function's body, its docstring aside: what reads on one screen. The longest today (the ASGI entry point
# daemon/http.py's `handle`, metrics `collect`, the fused decoder's `__init__`, `parse_config`) sit at 78-87.
MAX_FUNCTION_LINES = 90


def body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's end."""
    first = fn.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
        isinstance(first.value.value, str) and len(fn.body) > 1
    start = fn.body[1].lineno if docstring else first.lineno
    assert fn.end_lineno is not None
    return fn.end_lineno - start + 1


def test_functions_stay_short() -> None:
    """Whole classes, composed; the functions in them short enough to read (no cap on a module's length)."""
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and body_lines(node) > MAX_FUNCTION_LINES:
                long.append(f"{name}.{node.name}: {body_lines(node)} lines")
    assert long == []


TESTS = ROOT / "tests"
# frozen wire data, kept byte for byte where it was recorded
FROZEN = {"proto_frozen_schemas.py", "proto_frozen_probes.py"}


def test_the_top_of_tests_holds_only_tests() -> None:
    """Shared test code lives in tests/support/; at the top of tests/ are test files, conftest.py and the frozen
    wire data."""
    stray = [p.name for p in sorted(TESTS.glob("*.py"))
             if not p.name.startswith("test_") and p.name not in {"__init__.py", "conftest.py", *FROZEN}]
    assert stray == []


def test_no_test_file_imports_another() -> None:
    """What several test files use is in tests/support/, never taken from another test file."""
    importing = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []
            if any(part.startswith("test_") for name in names for part in name.split(".")):
                importing.append(f"{path.relative_to(ROOT)}: {', '.join(names)}")
    assert importing == []
