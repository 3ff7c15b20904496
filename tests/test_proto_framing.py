"""FrameDecoder / encode_frame: u32 LE length + payload, fed whole, byte by byte and with trailing bytes."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_gpuworker._errors import FrameTooLarge, LocalProtocolError, RemoteProtocolError
from trio_gpuworker._proto import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame, frame_prefix


def prefix(n: int) -> bytes:
    return struct.pack("<I", n)


def whole(data: bytes) -> Iterator[bytes]:
    yield data


def bytewise(data: bytes) -> Iterator[bytes]:
    for i in range(len(data)):
        yield data[i : i + 1]


def halves(data: bytes) -> Iterator[bytes]:
    yield data[: len(data) // 2]
    yield data[len(data) // 2 :]


FEEDS = [whole, bytewise, halves]


def decode(dec: FrameDecoder, data: bytes, feed: Callable[[bytes], Iterator[bytes]]) -> list[bytes]:
    """Feed `data` in the given chunks, draining complete frames after every chunk."""
    out: list[bytes] = []
    for chunk in feed(data):
        dec.feed(chunk)
        while (payload := dec.next_frame()) is not None:
            out.append(payload)
    return out


def test_encode_frame() -> None:
    assert encode_frame(b"") == b"\x00\x00\x00\x00"
    assert encode_frame(b"abc") == b"\x03\x00\x00\x00abc"
    assert encode_frame(memoryview(b"xy")) == b"\x02\x00\x00\x00xy"
    assert encode_frame(b"x" * 300) == b"\x2c\x01\x00\x00" + b"x" * 300
    assert frame_prefix(0x01020304) == b"\x04\x03\x02\x01"


def test_encode_frame_refuses_oversize() -> None:
    assert encode_frame(b"x" * 10, max_frame=10) == prefix(10) + b"x" * 10
    with pytest.raises(LocalProtocolError):
        encode_frame(b"x" * 11, max_frame=10)
    with pytest.raises(LocalProtocolError):
        frame_prefix(DEFAULT_MAX_FRAME + 1)
    assert frame_prefix(DEFAULT_MAX_FRAME) == prefix(DEFAULT_MAX_FRAME)


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize("payload", [b"", b"a", b"hello world", bytes(range(256)) * 5])
def test_one_frame(feed: Callable[[bytes], Iterator[bytes]], payload: bytes) -> None:
    dec = FrameDecoder()
    assert decode(dec, encode_frame(payload), feed) == [payload]
    assert dec.buffered == 0
    assert dec.next_frame() is None


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize(
    "trailing",
    [
        b"\x05",  # part of the next frame's prefix
        prefix(5),  # the next frame's whole prefix
        prefix(5) + b"ab",  # and part of its payload
        b"\xde\xad\xbe",  # garbage that is not yet a prefix
    ],
)
def test_trailing_bytes_stay_buffered(feed: Callable[[bytes], Iterator[bytes]], trailing: bytes) -> None:
    dec = FrameDecoder()
    assert decode(dec, encode_frame(b"first") + trailing, feed) == [b"first"]
    assert dec.buffered == len(trailing)
    assert dec.next_frame() is None


def test_trailing_prefix_completes_later() -> None:
    dec = FrameDecoder()
    assert decode(dec, encode_frame(b"one") + prefix(3) + b"t", whole) == [b"one"]
    assert dec.pending_frame_bytes() == 2
    assert decode(dec, b"wo", whole) == [b"two"]
    assert dec.pending_frame_bytes() == 0


@pytest.mark.parametrize("feed", FEEDS)
def test_several_frames_in_one_feed(feed: Callable[[bytes], Iterator[bytes]]) -> None:
    payloads = [b"a", b"", b"bc" * 100, b"\x00\x00\x00\x00", b"z"]
    dec = FrameDecoder()
    assert decode(dec, b"".join(map(encode_frame, payloads)), feed) == payloads
    assert dec.buffered == 0


def test_many_frames_fed_in_pieces_compact_correctly() -> None:
    # exercises the buffer compaction in feed(): the read position keeps moving while data arrives
    payloads = [bytes([i]) * i for i in range(200)]
    data = b"".join(map(encode_frame, payloads))
    dec = FrameDecoder()
    out: list[bytes] = []
    for i in range(0, len(data), 7):
        out += decode(dec, data[i : i + 7], whole)
    assert out == payloads


def test_pending_frame_bytes() -> None:
    dec = FrameDecoder()
    assert dec.pending_frame_bytes() == 0
    dec.feed(b"\x0a\x00")
    assert dec.pending_frame_bytes() == 0  # prefix incomplete: nothing started
    dec.feed(b"\x00\x00abc")
    assert dec.pending_frame_bytes() == 7
    assert dec.next_frame() is None


def test_frame_at_max_is_fine() -> None:
    dec = FrameDecoder(max_frame=10)
    assert decode(dec, encode_frame(b"x" * 10), bytewise) == [b"x" * 10]


@pytest.mark.parametrize("length", [11, 0xFFFFFFF0, 0xFFFFFFFF])
def test_oversize_length_rejected_from_prefix_alone(length: int) -> None:
    dec = FrameDecoder(max_frame=10)
    dec.feed(prefix(length)[:3])
    assert dec.next_frame() is None  # three bytes are not a length yet
    dec.feed(prefix(length)[3:])
    with pytest.raises(FrameTooLarge):
        dec.next_frame()  # no payload byte has arrived
    assert dec.buffered == 4


def test_oversize_default_max_frame() -> None:
    dec = FrameDecoder()
    dec.feed(prefix(DEFAULT_MAX_FRAME))
    assert dec.next_frame() is None
    dec = FrameDecoder()
    dec.feed(prefix(DEFAULT_MAX_FRAME + 1))
    with pytest.raises(FrameTooLarge):
        dec.next_frame()


def test_oversize_after_good_frames() -> None:
    dec = FrameDecoder(max_frame=10)
    dec.feed(encode_frame(b"ok") + prefix(11) + b"never looked at")
    assert dec.next_frame() == b"ok"
    with pytest.raises(FrameTooLarge):
        dec.next_frame()


def test_after_fault_every_call_fails_with_the_same_error() -> None:
    dec = FrameDecoder(max_frame=10)
    dec.feed(prefix(11))
    with pytest.raises(FrameTooLarge) as first:
        dec.next_frame()
    for call in (dec.next_frame, lambda: dec.feed(encode_frame(b"fine"))):
        with pytest.raises(FrameTooLarge) as again:
            call()
        assert again.value is first.value


def test_lowering_max_frame_applies_to_the_next_prefix() -> None:
    dec = FrameDecoder()
    dec.feed(encode_frame(b"x" * 20))
    dec.max_frame = 10
    with pytest.raises(FrameTooLarge):
        dec.next_frame()


# --- properties ---------------------------------------------------------------------------------


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@settings(max_examples=150, deadline=None)
@given(payloads=st.lists(st.binary(max_size=40), max_size=8), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_round_trip_under_any_chunking(payloads: list[bytes], cuts: list[int]) -> None:
    data = b"".join(encode_frame(p) for p in payloads)
    dec = FrameDecoder(max_frame=40)
    out: list[bytes] = []
    for chunk in split(data, cuts):
        out += decode(dec, chunk, whole)
    assert out == payloads
    assert dec.buffered == 0


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200), cuts=st.lists(st.integers(0, 200), max_size=10),
       max_frame=st.sampled_from([0, 1, 16, DEFAULT_MAX_FRAME]))
def test_fuzz_arbitrary_bytes(data: bytes, cuts: list[int], max_frame: int) -> None:
    dec = FrameDecoder(max_frame=max_frame)
    try:
        for chunk in split(data, cuts):
            dec.feed(chunk)
            while (payload := dec.next_frame()) is not None:
                assert isinstance(payload, bytes)
                assert len(payload) <= max_frame
    except RemoteProtocolError as exc:
        assert isinstance(exc, FrameTooLarge)
