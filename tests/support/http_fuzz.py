"""What the HTTP fuzz tests share: how many cases they draw, strategies for any JSON and any text (lone surrogates
included), sampling fields right or wrong, raw bodies, and one request sent in-process through the ASGI app."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import trio
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "10000"))
PER_EXAMPLE = 10  # cases drawn per hypothesis example: its per-example bookkeeping is most of a case's cost
CASE_TIMEOUT_S = 10.0

# any text, lone surrogates included (JSON can carry them as \ud800 escapes)
TEXT = st.text(st.characters(exclude_categories=()), max_size=40)
SCALAR = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
JSON = st.recursive(SCALAR, lambda c: st.lists(c, max_size=4) | st.dictionaries(TEXT, c, max_size=4),
                    max_leaves=12)
NUMBER = st.integers(-2, 3) | st.floats(-2, 3) | st.booleans()
SAMPLING = {"temperature": NUMBER, "top_p": NUMBER, "seed": st.integers(), "stop": st.lists(TEXT, max_size=2),
            "n": st.integers(-1, 3), "stream": st.booleans(), "logprobs": st.booleans() | st.integers(0, 5),
            "frequency_penalty": NUMBER, "presence_penalty": NUMBER, "logit_bias": st.dictionaries(TEXT, NUMBER),
            "user": TEXT, "top_k": st.integers(-1, 5), "stream_options": JSON}
RAW = st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode())


def encode(body: Any) -> bytes:
    """A case's body as bytes: JSON-encoded unless it is raw bytes already."""
    return json.dumps(body).encode() if not isinstance(body, bytes) else body


async def asgi_status(app: Callable[..., Any], method: str, path: str, body: bytes, query: bytes = b"") -> int:
    """The status `app` answers one request with, sent in-process through ASGI within CASE_TIMEOUT_S."""
    scope = {"type": "http", "method": method, "path": path, "client": ("127.0.0.1", 1), "query_string": query,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if delivered:
            await trio.sleep_forever()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with trio.fail_after(CASE_TIMEOUT_S):
        await app(scope, receive, send)
    return sent[0]["status"]
