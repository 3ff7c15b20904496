"""Request bodies: the bounded read of the JSON body a route takes, the discard of a body an early answer
leaves unread, and the threads large JSON bodies (and answers) are coded in.

An answer sent before its request's body was read (404, 401, 405, a bad query) leaves hypercorn's HTTP/1.1
connection mid-request, so hypercorn closes it right after the answer. The answer does not say so, and a
keep-alive client that sends its next request in that instant loses it ("server disconnected without sending a
response"). So a small unread body is read and dropped first, which keeps the connection reusable; a large, slow
or malformed one is not read, and the answer says `connection: close`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import trio

from .._errors import InvalidRequest, RequestTooLarge
from .http_common import ClientGone, HttpError, Raw, Receive, Scope

# An unread body up to this size is drained so the connection survives the error (Go's net/http drains 256 KiB)
DISCARD_MAX_BYTES = 256 * 1024


def content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                n = int(value)
            except ValueError:
                raise HttpError.like(InvalidRequest, "Content-Length is not an integer",
                                     {"connection": "close"}) from None
            return n if n >= 0 else None
    return None


def _chunked(scope: Scope) -> bool:
    return any(name.lower() == b"transfer-encoding" for name, _ in scope.get("headers", ()))


async def read_body(scope: Scope, receive: Receive, limit: int, timeout_s: float) -> bytes:
    """The whole body, refused past `limit` bytes (413, declared or counted) or `timeout_s` seconds (408); both
    answers close the connection, since the rest of the body is never read."""
    declared = content_length(scope)
    if declared is not None and declared > limit:  # refused before a byte of it is read
        raise HttpError.like(RequestTooLarge, f"request body of {declared} bytes exceeds {limit} bytes "
                                              "(http.max_body_bytes)", {"connection": "close"})
    chunks: list[bytes] = []
    size = 0
    try:
        with trio.fail_after(timeout_s):
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise ClientGone
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise HttpError.like(RequestTooLarge, f"request body exceeds {limit} bytes "
                                                          "(http.max_body_bytes)", {"connection": "close"})
                chunks.append(chunk)
                if not msg.get("more_body"):
                    return b"".join(chunks)
    except trio.TooSlowError:
        raise HttpError(408, "request_timeout", f"the request body did not arrive within {timeout_s:g} s "
                                                "(http.body_timeout_s)", {"connection": "close"}) from None


async def discard_body(scope: Scope, receive: Receive, limit: int, timeout_s: float) -> bool:
    """Read and drop a body nobody read. True when the connection can carry another request afterwards: there
    was no body, or it came whole within `min(limit, DISCARD_MAX_BYTES)` bytes and `timeout_s`."""
    try:
        declared = content_length(scope)
    except HttpError:
        return False
    if declared == 0 or (declared is None and not _chunked(scope)):
        return True
    cap = min(limit, DISCARD_MAX_BYTES)
    if declared is not None and declared > cap:
        return False
    try:
        await read_body(scope, receive, cap, timeout_s)
    except (HttpError, ClientGone):
        return False
    return True


def decode_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HttpError(400, "invalid_json", f"request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise HttpError(400, "invalid_json", "request body is nested too deeply") from None


class JsonThreads:
    """Large bodies decode, and large answers encode, in a few threads: tens of milliseconds of JSON never run on
    the loop."""

    def __init__(self, threads: int) -> None:
        self.limiter = trio.CapacityLimiter(threads)

    async def decode(self, data: bytes) -> Any:
        return await trio.to_thread.run_sync(decode_json, data, limiter=self.limiter)

    async def encoded(self, answer: Callable[[], Any]) -> Raw:
        """`answer()` built and encoded in a thread: thousands of vectors (or ids) as a 200."""
        body = await trio.to_thread.run_sync(lambda: json.dumps(answer(), separators=(",", ":")).encode(),
                                             limiter=self.limiter)
        return Raw(200, body, "application/json")


__all__ = ["DISCARD_MAX_BYTES", "JsonThreads", "content_length", "decode_json", "discard_body", "read_body"]
