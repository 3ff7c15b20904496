"""Device Bridge (docs/architecture.md, 'The worker side'): allocations, bounds-checked range copies, tensor views,
outputs."""

from __future__ import annotations

import ctypes
import functools
import gc
import hashlib
from collections.abc import Callable

import numpy as np
import pytest
from tinygrad import Device, Tensor, dtypes

from trio_gpuworker.worker._bridge import DeviceAlloc, DeviceBridge, DeviceError, DeviceRangeError

SIZES = [0, 1, 3, 63, 64, 65, 4095, 4097, (1 << 20) + 7]
MiB = 1 << 20


@pytest.fixture(scope="module", params=["direct", "generic"])
def bridge(request: pytest.FixtureRequest) -> DeviceBridge:
    """The CPU bridge both ways: memmove into the host address, and tinygrad's Buffer.copy_from path."""
    br = DeviceBridge(generic=request.param == "generic")
    assert br.device == "CPU" and br.direct == (request.param == "direct")
    return br


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(request.node.nodeid.encode()).digest()[:4], "little"))


def _read(br: DeviceBridge, a: DeviceAlloc) -> bytes:
    out = bytearray(a.nbytes)
    br.device_to_host(a, 0, out, a.nbytes)
    return bytes(out)


def _chunks(rng: np.random.Generator, n: int, max_chunk: int) -> list[tuple[int, int]]:
    """[offset, offset + len) pieces covering [0, n) in order, of random (mostly unaligned) lengths."""
    out, off = [], 0
    while off < n:
        k = int(rng.integers(1, max_chunk + 1))
        out.append((off, min(k, n - off)))
        off += k
    return out


# --- allocation and round trips -------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_in_unaligned_pieces(bridge: DeviceBridge, rng: np.random.Generator, size: int) -> None:
    data = rng.integers(0, 256, size, dtype=np.uint8)
    a = bridge.alloc_device(size)
    assert (a.nbytes, a.device) == (size, "CPU")
    kinds = [lambda b: b.tobytes(), bytearray, memoryview, lambda b: b, lambda b: b.ctypes.data]
    for i, (off, n) in enumerate(_chunks(rng, size, max(1, size // 5 + 3))):
        piece = data[off : off + n]
        bridge.host_to_device(a, off, kinds[i % len(kinds)](piece), n)
    assert _read(bridge, a) == data.tobytes()
    for off, n in _chunks(rng, size, max(1, size // 7 + 1)):  # read back in other pieces, at unaligned offsets
        dst = np.full(n + 3, 0xAB, np.uint8)
        bridge.device_to_host(a, off, dst[1:].ctypes.data if off % 2 else dst[1:], n)
        assert (
            dst[1 : n + 1].tobytes() == data[off : off + n].tobytes()
            and dst[0] == 0xAB
            and dst[-2:].tolist() == [0xAB] * 2
        )
    bridge.free_device(a)


def test_overwrite_at_offsets_and_zero_length(bridge: DeviceBridge, rng: np.random.Generator) -> None:
    model = bytearray(rng.integers(0, 256, 1000, dtype=np.uint8).tobytes())
    a = bridge.alloc_device(1000)
    bridge.host_to_device(a, 0, bytes(model), 1000)
    for _ in range(50):
        off = int(rng.integers(0, 1001))
        n = int(rng.integers(0, 1001 - off))
        src = rng.integers(0, 256, n + 5, dtype=np.uint8).tobytes()
        bridge.host_to_device(a, off, src, n)  # the first n bytes of a longer buffer
        model[off : off + n] = src[:n]
    assert _read(bridge, a) == bytes(model)
    bridge.host_to_device(a, 1000, b"", 0)  # empty range at the end is fine
    bridge.device_to_host(a, 1000, bytearray(), 0)
    bridge.host_to_device(a, 0, 0, 0)  # no bytes, no address needed
    bridge.free_device(a)


def test_zero_byte_allocation(bridge: DeviceBridge) -> None:
    a = bridge.alloc_device(0)
    assert a.nbytes == 0 and a.buffer is None
    if bridge.direct:
        assert bridge.host_address(a) == 0
    bridge.host_to_device(a, 0, b"", 0)
    assert _read(bridge, a) == b""
    t = bridge.as_tensor(a, "float32", (0, 4))
    assert t.shape == (0, 4) and t.numpy().shape == (0, 4)
    with pytest.raises(DeviceRangeError):
        bridge.host_to_device(a, 0, b"x", 1)
    bridge.free_device(a)


def test_64_mib_object_through_a_small_window(bridge: DeviceBridge, rng: np.random.Generator) -> None:
    """An object far larger than a ring: copied in ~1 MiB unaligned prefixes, as ingress would."""
    n = 64 * MiB
    data = rng.integers(0, 256, n, dtype=np.uint8)
    a = bridge.alloc_device(n)
    window = np.empty(MiB + 13, np.uint8)  # one reused host window, like a ring span
    for off, k in _chunks(rng, n, MiB + 13):
        window[:k] = data[off : off + k]
        bridge.host_to_device(a, off, window.ctypes.data, k)
    t = bridge.as_tensor(a, "float32", (n // 4 // 1024, 1024))
    got = t.numpy()
    assert hashlib.sha256(got.tobytes()).digest() == hashlib.sha256(data.tobytes()).digest()
    back = np.empty(n, np.uint8)
    for off, k in _chunks(rng, n, MiB - 5):  # egress-style readback
        bridge.device_to_host(a, off, back[off:], k)
    assert np.array_equal(back, data)
    del t, got
    bridge.free_device(a)


def test_host_address_is_the_buffer_memory(bridge: DeviceBridge) -> None:
    a = bridge.alloc_device(256)
    if not bridge.direct:
        with pytest.raises(DeviceError) as ei:
            bridge.host_address(a)
        assert ei.value.code == "device_copy_failed"
        return
    addr = bridge.host_address(a)
    assert addr == a.buffer._buf.va_addr and addr % 64 == 0
    ctypes.memmove(addr + 10, b"direct bytes", 12)
    assert _read(bridge, a)[10:22] == b"direct bytes"
    assert bytes(bridge.as_tensor(a, "uint8", (256,)).numpy()[10:22]) == b"direct bytes"


# --- bounds and handles ---------------------------------------------------------------------


def test_out_of_range_copies_raise(bridge: DeviceBridge) -> None:
    a = bridge.alloc_device(100)
    bridge.host_to_device(a, 0, bytes(range(100)), 100)
    bad = [
        (100, 1),  # one past the end
        (0, 101),
        (99, 2),
        (-1, 1),
        (2**64 - 1, 2),  # offset + n wraps u64
        (0, -1),
        (1.0, 1),
        (0, True),
    ]
    for off, n in bad:
        for call in (
            lambda off=off, n=n: bridge.host_to_device(a, off, bytes(200), n),
            lambda off=off, n=n: bridge.device_to_host(a, off, bytearray(200), n),
        ):
            with pytest.raises(DeviceRangeError) as ei:
                call()
            assert ei.value.code == "device_copy_failed" and isinstance(ei.value, ValueError)
    with pytest.raises(DeviceRangeError, match="holds 10 bytes"):  # host side shorter than n
        bridge.host_to_device(a, 0, bytes(10), 11)
    with pytest.raises(DeviceRangeError, match="holds 10 bytes"):
        bridge.device_to_host(a, 0, bytearray(10), 11)
    with pytest.raises(DeviceRangeError, match="read-only"):
        bridge.device_to_host(a, 0, b"\0" * 10, 10)
    with pytest.raises(DeviceRangeError, match="C-contiguous"):
        bridge.host_to_device(a, 0, np.zeros(40, np.uint8)[::2], 10)
    with pytest.raises(DeviceRangeError, match="not a valid pointer"):
        bridge.host_to_device(a, 0, 0, 10)
    with pytest.raises(DeviceRangeError, match="address or a buffer"):
        bridge.host_to_device(a, 0, "not bytes", 3)
    assert _read(bridge, a) == bytes(range(100))  # nothing was written by the failed calls
    bridge.free_device(a)


def test_freed_and_foreign_handles(bridge: DeviceBridge) -> None:
    a = bridge.alloc_device(16)
    bridge.free_device(a)
    assert a.freed and a.buffer is None
    for call in (
        lambda: bridge.free_device(a),
        lambda: bridge.host_to_device(a, 0, bytes(16), 16),
        lambda: bridge.device_to_host(a, 0, bytearray(16), 16),
        lambda: bridge.as_tensor(a, "uint8", (16,)),
        lambda: bridge.host_address(a),
        lambda: bridge.free_device(DeviceAlloc(16, "NV", None)),
        lambda: bridge.free_device("handle"),  # type: ignore[arg-type]
    ):
        with pytest.raises(DeviceError) as ei:
            call()
        assert ei.value.code == "invalid_device_handle"


def test_bad_allocation_sizes(bridge: DeviceBridge) -> None:
    for n in (-1, 1.5, None, True):
        with pytest.raises(DeviceError) as ei:
            bridge.alloc_device(n)  # type: ignore[arg-type]
        assert ei.value.code == "device_allocation_failed"


def test_allocation_beyond_the_address_space_is_oom(bridge: DeviceBridge) -> None:
    with pytest.raises(DeviceError) as ei:
        bridge.alloc_device(1 << 60)
    assert ei.value.code == "device_out_of_memory"
    a = bridge.alloc_device(4096)  # the device still works
    bridge.free_device(a)


def test_freed_memory_is_reused_without_leaking(bridge: DeviceBridge) -> None:
    from tinygrad.helpers import GlobalCounters

    gc.collect()
    before = GlobalCounters.mem_used_per_device["CPU"]
    used = []
    for _ in range(20):
        bridge.free_device(bridge.alloc_device(3 * MiB + 1))
        b = bridge.from_tensor(Tensor.arange(1000).float() * 2)
        bridge.free_device(b)
        gc.collect()
        used.append(GlobalCounters.mem_used_per_device["CPU"])
    assert len(set(used)) == 1  # freed buffers are recycled (direct) or released: no growth
    bridge.trim()
    gc.collect()
    # every 3 MiB allocation is back; tinygrad may keep a few bytes of constants it realized on the way
    assert GlobalCounters.mem_used_per_device["CPU"] - before < 1024


def test_recycled_buffer_is_reused_for_the_same_size(bridge: DeviceBridge) -> None:
    a = bridge.alloc_device(MiB)
    buf = a.buffer
    bridge.free_device(a)
    b = bridge.alloc_device(MiB)
    assert (b.buffer is buf) == bridge.direct  # only host-addressable memory is pooled
    bridge.free_device(b)
    bridge.trim()


# --- tensor views -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        ("uint8", (7, 3)),
        ("float32", (5, 4)),
        ("int32", (20,)),
        ("float16", (2, 2, 5)),
        ("int64", (10,)),
        ("float32", ()),
        ("bool", (3,)),
    ],
)
def test_as_tensor_is_the_bytes(bridge: DeviceBridge, rng: np.random.Generator, dtype: str, shape: tuple) -> None:
    npd = np.dtype(dtype)
    ref = rng.integers(0, 2, shape).astype(npd) if dtype == "bool" else rng.standard_normal(shape).astype(npd)
    if dtype in ("int32", "int64"):
        ref = rng.integers(-(2**31), 2**31, shape).astype(npd)
    a = bridge.alloc_device(ref.nbytes)
    bridge.host_to_device(a, 0, ref.tobytes(), ref.nbytes)
    t = bridge.as_tensor(a, dtype, shape)
    assert t.shape == shape and t.device == "CPU"
    got = t.numpy()
    assert got.dtype == npd and got.tobytes() == ref.tobytes()
    if dtype in ("float32", "float16"):  # and it computes
        np.testing.assert_allclose((t * 2 + 1).numpy(), ref * 2 + 1, rtol=1e-3)


def test_as_tensor_checks_its_view(bridge: DeviceBridge) -> None:
    a = bridge.alloc_device(24)
    for dtype, shape in [("float32", (5,)), ("float32", (7,)), ("float64", (4,)), ("uint8", (4, 5))]:
        with pytest.raises(DeviceRangeError) as ei:
            bridge.as_tensor(a, dtype, shape)
        assert ei.value.code == "invalid_input_handle"
    for dtype, shape in [("complex64", (3,)), ("float", (6,)), ("float32", (-6, -1)), ("float32", (6.0,))]:
        with pytest.raises(DeviceRangeError):
            bridge.as_tensor(a, dtype, shape)  # type: ignore[arg-type]
    assert bridge.as_tensor(a, np.float32, (6,)).shape == (6,)  # numpy dtypes and tinygrad dtypes work too
    assert bridge.as_tensor(a, dtypes.int16, (3, 4)).shape == (3, 4)


def test_a_view_keeps_memory_alive_after_free(bridge: DeviceBridge) -> None:
    ref = np.arange(64, dtype=np.float32)
    a = bridge.alloc_device(ref.nbytes)
    bridge.host_to_device(a, 0, ref, ref.nbytes)
    t = bridge.as_tensor(a, "float32", (8, 8))
    buf = a.buffer
    bridge.free_device(a)  # the handle dies; the memory waits for the tensor
    assert buf.is_allocated()
    assert np.array_equal((t + 1).numpy().ravel(), ref + 1)
    fresh = bridge.alloc_device(ref.nbytes)  # must not be handed t's memory
    assert fresh.buffer is not buf
    bridge.host_to_device(fresh, 0, bytes(ref.nbytes), ref.nbytes)
    assert np.array_equal(t.numpy().ravel(), ref)
    bridge.free_device(fresh)


# --- outputs ----------------------------------------------------------------------------------


def test_from_tensor_of_a_computation(
    bridge: DeviceBridge, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = rng.standard_normal((33, 17)).astype(np.float32)
    w = rng.standard_normal((17, 5)).astype(np.float32)
    clones: list[Tensor] = []
    real_clone = Tensor.clone
    monkeypatch.setattr(Tensor, "clone", lambda self, *a, **k: clones.append(self) or real_clone(self, *a, **k))
    out = bridge.from_tensor(Tensor(x) @ Tensor(w) + 1)
    assert out.nbytes == 33 * 5 * 4 and out.device == "CPU"
    assert not clones  # an unrealized result is realized straight into the allocation's buffer, no copy
    got = np.frombuffer(_read(bridge, out), np.float32).reshape(33, 5)
    np.testing.assert_allclose(got, x @ w + 1, rtol=1e-5, atol=1e-5)
    if bridge.direct:
        addr = bridge.host_address(out)
        assert ctypes.string_at(addr, out.nbytes) == got.tobytes()
    part = bytearray(7)
    bridge.device_to_host(out, 13, part, 7)  # egress-style partial reads
    assert bytes(part) == got.tobytes()[13:20]
    bridge.free_device(out)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda src: src, id="input-as-is"),
        pytest.param(lambda src: src.reshape(-1), id="reshape"),
        pytest.param(lambda src: src[1:3], id="contiguous-slice"),
        pytest.param(lambda src: src.T, id="transpose"),
        pytest.param(lambda src: src.bitcast(dtypes.int32), id="bitcast"),
        pytest.param(lambda src: Tensor(3.5), id="const"),
        pytest.param(lambda src: Tensor.full((2, 3), 7, dtype=dtypes.int16), id="full"),
    ],
)
def test_from_tensor_owns_its_bytes(bridge: DeviceBridge, make: Callable[[Tensor], Tensor]) -> None:
    ref = np.arange(16, dtype=np.float32).reshape(4, 4) - 3.25
    a = bridge.alloc_device(ref.nbytes)
    bridge.host_to_device(a, 0, ref, ref.nbytes)
    src = bridge.as_tensor(a, "float32", (4, 4))
    t = make(src)
    want = t.numpy().tobytes()
    out = bridge.from_tensor(t)
    assert out.nbytes == len(want) and _read(bridge, out) == want
    assert out.buffer is not a.buffer and out.buffer._base is None  # never aliases the input allocation
    bridge.host_to_device(a, 0, bytes(ref.nbytes), ref.nbytes)  # rewriting the input leaves the output alone
    assert _read(bridge, out) == want
    bridge.free_device(a)
    bridge.free_device(out)


def test_from_tensor_of_a_realized_weight_copies(bridge: DeviceBridge) -> None:
    w = Tensor(np.arange(12, dtype=np.float32) / 3).realize()
    assert w.uop.buffer.is_allocated()
    before = w.numpy().copy()
    out = bridge.from_tensor(w)
    assert out.buffer is not w.uop.buffer
    bridge.free_device(out)
    assert np.array_equal(w.numpy(), before) and w.uop.buffer.is_allocated()


def test_from_tensor_zero_size(bridge: DeviceBridge) -> None:
    out = bridge.from_tensor(Tensor.empty(0, 3))
    assert out.nbytes == 0 and out.buffer is None
    bridge.free_device(out)


# --- the generic path on a real accelerator --------------------------------------------------


@functools.cache
def _gpu() -> str | None:
    for name in ("NV", "CUDA"):
        try:
            Device[name]
        except Exception:
            continue
        return name
    return None


def test_generic_path_on_a_gpu(rng: np.random.Generator) -> None:
    if (dev := _gpu()) is None:
        pytest.skip("no CUDA/NV device in this tinygrad install")
    br = DeviceBridge(dev)
    assert not br.direct and br.device == dev
    n = 3 * MiB + 5
    data = rng.integers(0, 256, n, dtype=np.uint8)
    a = br.alloc_device(n)
    for off, k in _chunks(rng, n, MiB + 3):
        br.host_to_device(a, off, data[off:].ctypes.data, k)
    assert _read(br, a) == data.tobytes()
    with pytest.raises(DeviceError):
        br.host_address(a)
    with pytest.raises(DeviceRangeError):
        br.host_to_device(a, n - 1, data, 2)
    out = br.from_tensor(br.as_tensor(a, "uint8", (n,))[: 64 * 4].bitcast(dtypes.float32) * 2)
    got = np.frombuffer(_read(br, out), np.float32)
    np.testing.assert_array_equal(got, data[: 64 * 4].view(np.float32) * 2)
    part = bytearray(9)
    br.device_to_host(out, 3, part, 9)  # unaligned partial egress read
    assert bytes(part) == got.tobytes()[3:12]
    br.free_device(a)
    br.free_device(out)
