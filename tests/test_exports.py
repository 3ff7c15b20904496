"""The public API, in the manner of trio's test_exports.py: each public module's `__all__` is exactly the names it
promises (one disappearing, or one added without a word here, fails), no other public name leaks out of it, a
static reader of its `__init__` sees the same names, and every public name has its own docstring and types."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import inspect
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import trio_gpuworker

# A name added to or removed from one of these sets is a change of the public API, made on purpose.
API: dict[str, set[str]] = {
    "trio_gpuworker": {
        "AdmissionPolicy", "BatchPolicy", "BrokenWorkerError", "ClosedSupervisorError", "ConfigError",
        "DeadlineExceeded", "EngineCrashed", "GpuWorkerError", "InvalidRequest", "LaneConfig", "LaneNotFound",
        "LaneState", "LocalProtocolError", "ModelConfig", "ModelLoadFailed", "ModelLoading", "ModelNotFound",
        "NoLaneAvailable", "ObjectFailed", "OverCapacity", "ProtocolError", "QuarantinePolicy",
        "RemoteProtocolError", "RequestTooLarge", "RestartPolicy", "RingFault", "StaleHandle", "StepFailed",
        "Supervisor", "SupervisorConfig", "Windows", "WorkerError",
    },
    "trio_gpuworker.engine": {
        "Context", "EmbedRequest", "Engine", "GenerateRequest", "Generation", "LoadRequest", "Ranking",
        "RerankRequest", "UnloadRequest", "WorkerError", "serve",
    },
    "trio_gpuworker.testing": {
        "EVERY", "FAKE_MODEL", "FAKE_WORKER", "HANDSHAKE_FAULTS", "RANDOM_FAULTS", "REQUEST_FAULTS", "SIM_MODEL",
        "FaultPlan", "Schedule", "SimLauncher", "SimProc", "Simulation", "Step", "WorldShape", "fake_supervisor",
        "make_schedule", "run_schedule", "search", "search_schedules", "shrink", "simulate",
    },
}
PUBLIC_MODULES = sorted(API)
# the subpackages a program may import besides the top level (and testing's pytest plugin); the others are the
# daemon's and the worker's own
PUBLIC_SUBPACKAGES = {"engine", "testing", "pytest_plugin"}
INTERNAL_SUBPACKAGES = {"supervisor", "daemon", "worker", "models", "gguf_file", "llm_tokenizer", "tokenization",
                        "chat_template", "encoder_folder"}


def public_objects(name: str) -> Iterator[tuple[str, Any]]:
    module = importlib.import_module(name)
    for attr in module.__all__:
        yield f"{name}.{attr}", getattr(module, attr)


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_is_the_promised_api(name: str) -> None:
    module = importlib.import_module(name)
    assert len(module.__all__) == len(set(module.__all__)), "a name is listed twice"
    assert set(module.__all__) == API[name]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_no_other_public_name_leaks(name: str) -> None:
    module = importlib.import_module(name)
    assert not [n for n in module.__all__ if n.startswith("_")]
    runtime = {n for n in dir(module) if not n.startswith("_") and not isinstance(getattr(module, n), types.ModuleType)}
    assert runtime == set(module.__all__)
    submodules = {n for n in dir(module) if isinstance(getattr(module, n), types.ModuleType) and not n.startswith("_")}
    assert submodules <= PUBLIC_SUBPACKAGES | INTERNAL_SUBPACKAGES


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_a_static_reader_sees_the_same_names(name: str) -> None:
    """What a type checker or an IDE sees in the package's __init__: the public names it binds are `__all__`."""
    module = importlib.import_module(name)
    tree = ast.parse(Path(module.__file__ or "").read_text())
    bound = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Assign):
            bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
    assert {n for n in bound if not n.startswith("_")} == set(module.__all__)


def own_doc(obj: Any) -> str | None:
    """The object's own docstring: not one inherited, not the signature dataclasses write when there is none."""
    doc = vars(obj).get("__doc__") if isinstance(obj, type) else obj.__doc__
    if isinstance(obj, type) and dataclasses.is_dataclass(obj) and doc and doc.startswith(f"{obj.__name__}("):
        return None
    return doc.strip() if doc else None


def ours(klass: type) -> bool:
    return klass.__module__.split(".")[0] in ("trio_gpuworker", "cython_ring")


def public_methods(klass: type) -> Iterator[tuple[str, Callable[..., Any]]]:
    """The public methods and properties a class of ours defines or inherits from another class of ours."""
    seen: set[str] = set()
    for base in filter(ours, klass.__mro__):
        for attr, value in vars(base).items():
            if attr in seen or (attr.startswith("_") and attr != "__init__"):
                continue
            seen.add(attr)
            fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            fn = getattr(fn, "func", fn)  # functools.cached_property
            if inspect.isfunction(fn):
                yield f"{klass.__name__}.{attr}", fn


def everything_public() -> Iterator[tuple[str, Any]]:
    for name in PUBLIC_MODULES:
        yield from public_objects(name)


@pytest.mark.parametrize(("qualname", "obj"), [(q, o) for q, o in everything_public() if callable(o)])
def test_every_public_name_has_a_docstring(qualname: str, obj: Any) -> None:
    """Classes and functions; a constant is described where it is defined (a comment beside it)."""
    assert own_doc(obj), f"{qualname} has no docstring of its own"
    if isinstance(obj, type):
        undocumented = [m for m, fn in public_methods(obj) if not m.endswith(".__init__") and not fn.__doc__]
        assert undocumented == []


def untyped(fn: Callable[..., Any]) -> list[str]:
    sig = inspect.signature(fn)
    missing = [p.name for p in sig.parameters.values()
               if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    return missing + (["return"] if sig.return_annotation is inspect.Signature.empty else [])


@pytest.mark.parametrize(("qualname", "obj"), list(everything_public()))
def test_every_public_callable_is_typed(qualname: str, obj: Any) -> None:
    if isinstance(obj, type):
        assert {m: untyped(fn) for m, fn in public_methods(obj) if untyped(fn)} == {}
        if dataclasses.is_dataclass(obj):
            assert all(f.type for f in dataclasses.fields(obj))
    elif callable(obj):
        assert untyped(obj) == []


def test_the_pytest_plugin_is_documented_and_typed() -> None:
    from trio_gpuworker.testing import pytest_plugin

    for name in pytest_plugin.__all__:
        fn = getattr(pytest_plugin, name).__wrapped__  # the function under pytest's fixture wrapper
        assert fn.__doc__ and untyped(fn) == [], name


def test_the_version_is_the_packages() -> None:
    """`trio_gpuworker.__version__` is the version pip installed (setup.py reads the same one module)."""
    assert trio_gpuworker.__version__ == importlib.metadata.version("trio-gpuworker")
