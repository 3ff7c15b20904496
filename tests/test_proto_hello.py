"""HELLO and HELLO_ACK contents: the version (checked once, by the Handshake), the exact field sets, the
daemon's acceptance rules; fed whole, byte by byte, with trailing bytes, and fuzzed."""

from __future__ import annotations

import itertools
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.proto_connection import ctrl
from tests.support.proto_handshake import ACK, ENGINE, NONCE, PID, hello, hello_message, receive, rules
from trio_gpuworker._errors import (
    HandshakeError,
    LocalProtocolError,
    MalformedMessage,
    NonceMismatch,
    PidMismatch,
    RemoteProtocolError,
    RingAbiMismatch,
    VersionMismatch,
)
from trio_gpuworker._proto import (
    DAEMON,
    DEFAULT_MAX_FRAME,
    NEED_DATA,
    PROTOCOL_VERSION,
    RING_ABI,
    WORKER,
    Connection,
    HelloAck,
    WireMessage,
    decode,
    encode_frame,
)


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"v": 2}, id="v2-bare"),
        pytest.param({"v": 2, "nonce": NONCE}, id="v2-partial"),
        pytest.param({**hello(), "v": 2}, id="v2-complete"),
        pytest.param({**hello(), "v": 4}, id="v4"),
        pytest.param({**hello(), "v": "3"}, id="v-text"),
        pytest.param({"nonce": NONCE}, id="no-v"),
    ],
)
def test_hello_of_another_version_is_a_version_mismatch(fields: dict[str, Any]) -> None:
    with pytest.raises(VersionMismatch):
        receive(Connection(DAEMON), ctrl("HELLO", **fields))


def test_v3_hello_missing_fields_is_malformed_not_a_version_mismatch() -> None:
    with pytest.raises(MalformedMessage):
        receive(Connection(DAEMON), ctrl("HELLO", v=3, nonce=NONCE))


# --- HandshakeRules -----------------------------------------------------------------------------


def test_rules_accept() -> None:
    assert rules(generation=7).check_hello(hello_message()) == HelloAck(v=3, accept=True, max_frame=DEFAULT_MAX_FRAME,
                                                                        generation=7)


@pytest.mark.parametrize(("ours", "theirs"), [(1 << 20, DEFAULT_MAX_FRAME), (DEFAULT_MAX_FRAME, 1 << 20),
                                              (4096, 4096)])
def test_rules_negotiate_the_smaller_max_frame(ours: int, theirs: int) -> None:
    ack = rules(max_frame=ours).check_hello(hello_message(max_frame=theirs))
    assert ack.max_frame == min(ours, theirs)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"nonce": "00" * 16}, NonceMismatch),
        ({"nonce": NONCE.upper()}, NonceMismatch),
        ({"pid": PID + 1}, PidMismatch),
        ({"ring_abi": RING_ABI + 1}, RingAbiMismatch),
        ({"ring_abi": 1}, RingAbiMismatch),
        ({"max_frame": 4095}, HandshakeError),
        # nonce first, then pid, then the max_frame floor, then ring ABI (the version is the Handshake's)
        ({"nonce": "x", "pid": 1, "ring_abi": 9}, NonceMismatch),
        ({"pid": 1, "ring_abi": 9}, PidMismatch),
    ],
)
def test_rules_reject(overrides: dict[str, Any], error: type[HandshakeError]) -> None:
    with pytest.raises(error):
        rules().check_hello(hello_message(**overrides))


def test_rules_other_supported_ring_abis() -> None:
    assert rules(ring_abis=frozenset({1, 2})).check_hello(hello_message(ring_abi=1)).accept is True


def test_handshake_errors_are_remote_protocol_errors_with_codes() -> None:
    for error, code in [(VersionMismatch, "version_mismatch"), (NonceMismatch, "nonce_mismatch"),
                        (PidMismatch, "pid_mismatch"), (RingAbiMismatch, "ring_helper_abi_mismatch")]:
        assert issubclass(error, HandshakeError) and issubclass(error, RemoteProtocolError)
        assert error.code == code


# --- exact fields and the version ---------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param(hello(future_field=[1]), id="extra-key"),
        pytest.param(hello(engine={"engine": "fake", "version": "1"}), id="no-build-flags"),
        pytest.param(hello(engine={**ENGINE, "arch": "x"}), id="engine-extra-key"),
        pytest.param(hello(engine={**ENGINE, "build_flags": "cpu"}), id="build-flags-text"),
        pytest.param(hello(max_frame=1 << 32), id="max-frame-over-u32"),
        pytest.param(hello(max_frame=-1), id="max-frame-negative"),
        pytest.param(hello(pid=True), id="pid-bool"),
        pytest.param(hello(packed="yes"), id="packed-text"),
        pytest.param({k: v for k, v in hello().items() if k != "ring_abi"}, id="no-ring-abi"),
    ],
)
@pytest.mark.parametrize("bytewise", [False, True])
def test_hello_fields_are_exact(fields: dict[str, Any], bytewise: bool) -> None:
    with pytest.raises(MalformedMessage):
        receive(Connection(DAEMON), ctrl("HELLO", **fields), bytewise)
    with pytest.raises(LocalProtocolError):
        Connection(WORKER).send_map("HELLO", fields)


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({**ACK, "extra": 1}, id="extra-key"),
        pytest.param({k: v for k, v in ACK.items() if k != "generation"}, id="no-generation"),
        pytest.param({**ACK, "max_frame": 1 << 32}, id="max-frame-over-u32"),
        pytest.param({**ACK, "accept": 1}, id="accept-int"),
    ],
)
def test_ack_fields_are_exact(fields: dict[str, Any]) -> None:
    worker = Connection(WORKER)
    worker.send_map("HELLO", hello())
    with pytest.raises(MalformedMessage):
        receive(worker, ctrl("HELLO_ACK", **fields))
    daemon = Connection(DAEMON)
    receive(daemon, ctrl("HELLO", **hello()))
    with pytest.raises(LocalProtocolError):
        daemon.send_map("HELLO_ACK", fields)


@pytest.mark.parametrize("v", [2, 4, "3", None])
def test_worker_checks_the_acks_version(v: object) -> None:
    worker = Connection(WORKER)
    worker.send_map("HELLO", hello())
    with pytest.raises(VersionMismatch):
        receive(worker, ctrl("HELLO_ACK", **{**ACK, "v": v}))
    assert not worker.handshake_done


def test_we_cannot_send_another_version() -> None:
    with pytest.raises(LocalProtocolError):
        Connection(WORKER).send_map("HELLO", hello(v=2))
    daemon = Connection(DAEMON)
    receive(daemon, ctrl("HELLO", **hello()))
    with pytest.raises(LocalProtocolError):
        daemon.send_map("HELLO_ACK", {**ACK, "v": 4})


def test_worker_rejects_an_ack_above_its_max_frame() -> None:
    worker = Connection(WORKER, max_frame=1 << 20)
    worker.send_map("HELLO", hello(max_frame=1 << 20))
    with pytest.raises(HandshakeError):
        receive(worker, ctrl("HELLO_ACK", **ACK))


@pytest.mark.parametrize("trailing", [b"\x00", b"\x10\x00\x00"])
def test_hello_with_trailing_partial_frame_waits(trailing: bytes) -> None:
    daemon = Connection(DAEMON)
    assert receive(daemon, ctrl("HELLO", **hello()) + trailing) == [hello_message()]
    assert daemon.next_event() is NEED_DATA


# --- fuzz: the daemon's handshake decoder ------------------------------------------------------

cbor_values = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 66), 1 << 66) | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3), max_leaves=4)
keys = st.sampled_from(["v", "nonce", "engine", "pid", "max_frame", "ring_abi", "packed", "manifest_digest",
                        "kernel_revision", "build_flags", "extra", "t"])


@settings(max_examples=300, deadline=None)
@given(mutations=st.dictionaries(keys, cbor_values, max_size=3), drop=st.lists(keys, max_size=2),
       trailing=st.binary(max_size=12), cuts=st.lists(st.integers(1, 200), max_size=6))
def test_fuzz_the_daemons_handshake_decoder(mutations: dict[str, Any], drop: list[str], trailing: bytes,
                                            cuts: list[int]) -> None:
    fields = {k: v for k, v in {**hello(), **mutations}.items() if k not in drop}
    data = encode_frame(cbor2.dumps({"t": "HELLO", **fields})) + trailing
    points = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    daemon = Connection(DAEMON)
    got: list[WireMessage] = []
    try:
        for a, b in itertools.pairwise(points):
            got += receive(daemon, data[a:b])
        daemon.send_map("HELLO_ACK", ACK)
    except RemoteProtocolError as exc:
        with pytest.raises(RemoteProtocolError) as again:
            daemon.next_event()
        assert again.value is exc
        assert not daemon.handshake_done
        return
    # accepted only a complete, exact v3 HELLO with nothing behind it
    assert got == [decode("HELLO", fields)] and not trailing
    assert fields.get("v") == PROTOCOL_VERSION and set(fields) - {"t"} <= set(hello()) | {
        "packed", "manifest_digest", "kernel_revision"}
    assert daemon.handshake_done
