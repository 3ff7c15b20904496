"""Drain over real loopback sockets against a daemon with fake workers: a request is counted in flight from its
admission (its headers), so one still uploading its body when the drain starts is waited for and served, and a
request that arrives once admission stopped gets a typed 503."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import trio
from hypothesis import HealthCheck, given, settings
from tokenizers import Tokenizer

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import TOKENIZER, client_for, wait_until
from trio_gpuworker.daemon.main import Daemon

WORDS = ["hello", "world", "drain", "ring", "lease", "a", "the"]
TEXTS = st.lists(st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join), min_size=1, max_size=4)
DRAIN_S = 20.0  # far more than any example takes: a drain that ends before the answer did not wait for it
STILL_S = 0.2  # how long a drain that counts the upload is seen still waiting before the rest of the body comes


def post_head(length: int) -> bytes:
    return (b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % length)


async def late_request(url: str) -> tuple[int, object]:
    """A whole request on a new connection, once admission stopped: status and JSON body."""
    body = json.dumps({"model": MODEL, "input": ["late"]}).encode()
    stream = await connect(url)
    async with stream:
        await stream.send_all(post_head(len(body)) + body)
        return await answer_of(stream)


async def answer_of(stream: trio.SocketStream) -> tuple[int, object]:
    """The status and JSON body of one answer; (0, the bytes that came) when the connection ended without one."""
    data = b""
    with trio.fail_after(DRAIN_S):
        while b"\r\n\r\n" not in data and (chunk := await stream.receive_some(65536)):
            data += chunk
    if b"\r\n\r\n" not in data:
        return 0, data
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(v) for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")[1:])
                  if k.strip().lower() == b"content-length")
    with trio.fail_after(DRAIN_S):
        while len(body) < length:
            body += await stream.receive_some(65536)
    return int(head.split(b" ", 2)[1]), json.loads(body)


async def connect(url: str) -> trio.SocketStream:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def drain_during_upload(daemon: Daemon, texts: list[str], split: float) -> dict[str, object]:
    """Send the headers and part of the body, start the drain, finish the body: what each step saw."""
    url, api = daemon.binds[0], daemon.api
    body = json.dumps({"model": MODEL, "input": texts}).encode()
    cut = int(len(body) * split)
    stream = await connect(url)
    async with stream:
        await stream.send_all(post_head(len(body)) + body[:cut])
        await wait_until(lambda: api.in_flight_from("127.0.0.1") == 1)  # admitted: the route waits for its body
        daemon.stop_requested.set()  # what SIGTERM does
        await wait_until(lambda: not api.admitting)
        await trio.sleep(STILL_S)
        seen: dict[str, object] = {"drain_waiting": not daemon.stop_listeners.is_set()}
        seen["late"] = await late_request(url) if seen["drain_waiting"] else None
        await stream.send_all(body[cut:])
        seen["answer"] = await answer_of(stream)
    return seen


def expected_rows(texts: list[str]) -> list[list[float]]:
    """The fake worker's row per input, its first two columns: [sum(ids), n_tokens] of the MiniLM tokenization."""
    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.no_padding()  # the file pads to the model's length; the daemon sends each input's own tokens
    return [[float(sum(ids)), float(len(ids))] for ids in (tok.encode(t).ids for t in texts)]


@settings(max_examples=4, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(texts=TEXTS, split=st.floats(0.0, 0.95))
async def test_a_request_uploading_at_drain_is_served_and_waited_for(texts: list[str], split: float) -> None:
    with tempfile.TemporaryDirectory(prefix="gw-drain-") as tmp:  # short: worker socket paths live under it
        cfg = daemon_config(Path(tmp), fake_command(), http={"max_body_bytes": 1 << 16}, daemon={"drain_s": DRAIN_S})
        with trio.fail_after(DRAIN_S):
            async with trio.open_nursery() as nursery:  # run_daemon returns once drained and its workers stopped
                http, daemon = await client_for(nursery, cfg)
                await http.aclose()
                seen = await drain_during_upload(daemon, texts, split)
    assert seen["drain_waiting"], "drain ended while an admitted request was still uploading its body"
    status, late = seen["late"]
    assert status == 503 and late["error"]["code"] == "shutting_down"
    status, answer = seen["answer"]
    assert status == 200, answer
    assert [d["embedding"][:2] for d in answer["data"]] == expected_rows(texts)
