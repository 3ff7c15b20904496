"""Roles (docs/architecture.md, 'Device handles, roles and steps'): what one ExecuteStep computes from its input
tensors.

A role is made once from its JSON config (ConfigureRole, or the boot role) and then runs one step at
a time: `execute(inputs, runtime)` maps input port -> tinygrad Tensor to output port -> realized Tensor.
Loading objects, views and egress are the caller's (see _bridge.DeviceBridge); roles only compute.

Kinds:
  echo    {"kind": "echo"}                               in -> out, the same bytes, any dtype and shape
  linear  {"kind": "linear"}                             x [.., k], W [k, m], b [m] (float32) -> y = x @ W + b
  minilm  {"kind": "minilm", "model_ref": str,           ids int32 [n] (one sequence with [CLS]/[SEP])
           "pooling": "mean"|"cls", "normalize": bool}   -> embedding float32 [dims]

`runtime` is step-scoped and optional: {"progress": callable(n_done)} is passed to models that report it.
Every failure is a StepFailed whose `code` is a StepFailure / RoleFailure wire name: a role could not be
configured (invalid_role_config, backend_unsupported) or a step failed (invalid_input_handle, tinygrad_error,
device_out_of_memory, output_extent_invalid).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from .._errors import StepFailed
from .._kinds import EMBEDDING

if TYPE_CHECKING:
    from tinygrad import Tensor


class Role(Protocol):
    kind: str
    input_ports: tuple[str, ...]
    output_ports: tuple[str, ...]

    def execute(self, inputs: dict[str, Tensor], runtime: dict[str, Any]) -> dict[str, Tensor]: ...


def _tinygrad_failure(exc: BaseException, what: str) -> StepFailed:
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        return StepFailed("device_out_of_memory", f"{what}: {exc}")
    return StepFailed("tinygrad_error", f"{what}: {type(exc).__name__}: {exc}")


class _Base(abc.ABC):
    """Port checks and error mapping around a role's `_run`."""

    kind: ClassVar[str]
    input_ports: ClassVar[tuple[str, ...]]
    output_ports: ClassVar[tuple[str, ...]]
    config_keys: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: dict[str, Any], models: dict[str, Any]) -> None:
        if extra := set(config) - {"kind"} - self.config_keys:
            raise StepFailed("invalid_role_config", f"{self.kind} role: unknown config keys {sorted(extra)}")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind}>"

    def execute(self, inputs: dict[str, Tensor], runtime: dict[str, Any]) -> dict[str, Tensor]:
        from tinygrad import Tensor

        if set(inputs) != set(self.input_ports):
            raise StepFailed(
                "invalid_input_handle",
                f"{self.kind} role takes input ports {list(self.input_ports)}, got {sorted(inputs)}",
            )
        if bad := [p for p, t in inputs.items() if not isinstance(t, Tensor)]:
            raise StepFailed("invalid_input_handle", f"{self.kind} role: input {bad[0]!r} is not a tinygrad Tensor")
        try:
            out = self._run(inputs, runtime or {})
            Tensor.realize(*out.values())
        except StepFailed:
            raise
        except Exception as exc:
            raise _tinygrad_failure(exc, f"{self.kind} step") from exc
        return out

    @abc.abstractmethod
    def _run(self, inputs: dict[str, Tensor], runtime: dict[str, Any]) -> dict[str, Tensor]:
        """The role's computation, on validated input tensors."""


class EchoRole(_Base):
    """The input object back, byte for byte (from_tensor copies it into a buffer of its own)."""

    kind, input_ports, output_ports = "echo", ("in",), ("out",)

    def _run(self, inputs: dict[str, Tensor], runtime: dict[str, Any]) -> dict[str, Tensor]:
        return {"out": inputs["in"]}


class LinearRole(_Base):
    """y = x @ W + b in float32, shapes taken from the tensors: x [.., k] (or [k]), W [k, m], b [m]."""

    kind, input_ports, output_ports = "linear", ("x", "W", "b"), ("y",)

    def _run(self, inputs: dict[str, Tensor], runtime: dict[str, Any]) -> dict[str, Tensor]:
        from tinygrad import dtypes

        x, w, b = inputs["x"], inputs["W"], inputs["b"]
        if bad := [p for p, t in inputs.items() if t.dtype != dtypes.float32]:
            raise StepFailed("tinygrad_error", f"linear role: input {bad[0]!r} is {inputs[bad[0]].dtype}, not float32")
        if w.ndim != 2 or b.ndim != 1 or x.ndim < 1 or x.shape[-1] != w.shape[0] or b.shape[0] != w.shape[1]:
            raise StepFailed(
                "tinygrad_error",
                f"linear role: shapes x{list(x.shape)} W{list(w.shape)} b{list(b.shape)} "
                "do not fit x[.., k] W[k, m] b[m]",
            )
        return {"y": (x @ w + b).contiguous()}


class MiniLMRole(_Base):
    """Sentence embedding of one token-id sequence with a loaded BertEncoder (models[model_ref].impl)."""

    kind, input_ports, output_ports = "minilm", ("ids",), ("embedding",)
    config_keys = frozenset({"model_ref", "pooling", "normalize"})

    def __init__(self, config: dict[str, Any], models: dict[str, Any]) -> None:
        super().__init__(config, models)
        ref = config.get("model_ref")
        if not isinstance(ref, str) or not ref:
            raise StepFailed("invalid_role_config", f"minilm role: model_ref must be a non-empty string, got {ref!r}")
        if ref not in models:
            raise StepFailed("invalid_role_config", f"minilm role: model {ref!r} is not loaded")
        self.pooling, self.normalize = config.get("pooling", "mean"), config.get("normalize", True)
        if self.pooling not in ("mean", "cls"):
            raise StepFailed(
                "invalid_role_config", f"minilm role: pooling must be 'mean' or 'cls', got {self.pooling!r}"
            )
        if not isinstance(self.normalize, bool):
            raise StepFailed("invalid_role_config", f"minilm role: normalize must be a bool, got {self.normalize!r}")
        model = models[ref]
        if getattr(model, "kind", EMBEDDING) != EMBEDDING or not callable(getattr(model.impl, "embed", None)):
            raise StepFailed("backend_unsupported", f"minilm role: model {ref!r} is not an embedding model")
        self.model_ref, self.embed = ref, model.impl.embed

    def _run(self, inputs: dict[str, Tensor], runtime: dict[str, Any]) -> dict[str, Tensor]:
        from tinygrad import Tensor, dtypes

        ids = inputs["ids"]
        if ids.dtype != dtypes.int32 or ids.ndim != 1:
            raise StepFailed("tinygrad_error", f"minilm role: ids must be int32 [n], got {ids.dtype} {list(ids.shape)}")
        row = np.ascontiguousarray(ids.numpy(), dtype=np.int32)
        progress: Callable[[int], None] | None = runtime.get("progress")
        try:
            vec = self.embed([row], self.pooling, self.normalize, progress)
        except ValueError as exc:  # the model's own input checks: empty, too long, ids outside the vocabulary
            raise StepFailed("tinygrad_error", f"minilm role: {exc}") from exc
        return {"embedding": Tensor(np.ascontiguousarray(vec[0], dtype=np.float32), device=ids.device).contiguous()}


ROLES: dict[str, type[_Base]] = {r.kind: r for r in (EchoRole, LinearRole, MiniLMRole)}


def make_role(config: dict[str, Any], models: dict[str, Any]) -> Role:
    """A role from its JSON config; models maps model_ref -> a loaded model (see worker._engine)."""
    if not isinstance(config, dict):
        raise StepFailed("invalid_role_config", f"role config must be a JSON object, got {type(config).__name__}")
    kind = config.get("kind")
    if not isinstance(kind, str) or kind not in ROLES:
        raise StepFailed("invalid_role_config", f"role kind {kind!r} is not one of {sorted(ROLES)}")
    return ROLES[kind](config, models)
