"""trio_gpuworker.engine: what a class implements decides what it serves and advertises; the server owns HELLO and
the nonce, framing, PROGRESS, streamed text, CANCEL, SHUTDOWN and typed ERRs (docs/engines.md). The sessions here
are the real EngineServer on one end of a socket pair and a daemon-side Connection on the other."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from trio_gpuworker._channel import MessageReader
from trio_gpuworker._engine_server import EngineServer
from trio_gpuworker._errors import LocalProtocolError
from trio_gpuworker._proto import (
    DAEMON,
    EXT_CANCEL,
    EXT_LONG,
    EXT_POOLING,
    EXT_SAMPLING,
    EXT_STREAM,
    Cancel,
    Connection,
    EmbedBatch,
    Generate,
    Hello,
    HelloAck,
    Load,
    Ping,
    Shutdown,
    WireMessage,
)
from trio_gpuworker.engine import (
    Context,
    EmbedRequest,
    Engine,
    GenerateRequest,
    Generation,
    LoadRequest,
    WorkerError,
)

NONCE = "ab" * 16
THIS_FILE_SHA256 = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()  # an artifact every session has


class Embedder(Engine):
    def load(self, request: LoadRequest, ctx: Context) -> Any:
        request.verify()
        return {"dims": 2}

    def embed(self, request: EmbedRequest, ctx: Context) -> np.ndarray:
        if request.pooling == "cls":
            raise ValueError("this model pools by mean only")
        ctx.progress()
        return np.array([[float(ids.sum()), float(len(ids))] for ids in request.token_ids])


class Pooler(Embedder):
    poolings = ("mean", "max")

    def embed(self, request: EmbedRequest, ctx: Context) -> np.ndarray:
        if request.pooling == "max":
            return np.array([[float(ids.max()), float(len(ids))] for ids in request.token_ids])
        return super().embed(request, ctx)


class Echo(Engine):
    """Streams the prompt back, one token's text at a time, as slowly as `delay` says."""

    delay = 0.0

    def generate(self, request: GenerateRequest, ctx: Context) -> Iterator[str]:
        for token in request.prompt.tolist() * 1000:
            time.sleep(self.delay)  # on the compute thread, never the event loop
            yield f"<{token}>"


class Plain(Engine):
    sampling = True
    max_new_tokens = 4096

    def generate(self, request: GenerateRequest, ctx: Context) -> Generation:
        ctx.progress()
        return Generation("done", [7, 8], "stop")


def test_extensions_follow_what_the_class_implements() -> None:
    assert Engine().extensions() == Embedder().extensions() == frozenset()
    assert Echo().extensions() == {EXT_CANCEL, EXT_STREAM}
    assert Plain().extensions() == {EXT_CANCEL, EXT_SAMPLING, EXT_LONG}
    assert Pooler().extensions() == {EXT_POOLING}


def test_requests_follow_the_methods() -> None:
    assert {cls.T for cls in Embedder().handlers} == {"LOAD", "UNLOAD", "PING", "EMBED_BATCH"}
    with pytest.raises(WorkerError) as info:
        Embedder().handle(Generate(req_id=1, model_ref="m", max_tokens=1, raw=b""), lambda n, phase: None)
    assert info.value.code == "unsupported_request"


def test_context_refuses_progress_the_daemon_would_refuse() -> None:
    ctx = Context(1)
    ctx.progress()
    ctx.progress(5)
    assert ctx.completed == 5
    with pytest.raises(LocalProtocolError):
        ctx.progress(5)
    ctx.progress(phase="control")
    with pytest.raises(LocalProtocolError):
        ctx.progress(phase="inference")
    ctx.delta("a")
    with pytest.raises(LocalProtocolError):
        ctx.delta("b", n_gen=1)


class Daemon:
    """The daemon's end of a session: a Connection, its reader, and the stream."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.conn = Connection(DAEMON)
        self.stream = stream
        self.reader = MessageReader(self.conn, stream)
        self.req_id = 0

    async def send(self, msg: WireMessage) -> None:
        for chunk in self.conn.send(msg):
            await self.stream.send_all(chunk)

    async def request(self, cls: type[WireMessage], **fields: Any) -> int:
        self.req_id += 1
        await self.send(cls(req_id=self.req_id, **fields))
        return self.req_id

    async def receive(self) -> WireMessage:
        with trio.fail_after(10):
            msg = await self.reader.receive()
        assert msg is not None
        return msg

    async def reply(self) -> tuple[list[WireMessage], WireMessage]:
        """What precedes the terminal reply (PROGRESS, TEXT_DELTA), and the terminal reply."""
        before = []
        while (msg := await self.receive()).T in ("PROGRESS", "TEXT_DELTA"):
            before.append(msg)
        return before, msg


@asynccontextmanager
async def session(engine: Engine) -> AsyncIterator[tuple[Daemon, WireMessage]]:
    """The engine served on one end of a socket pair; the daemon's end past HELLO_ACK, with the HELLO."""
    ours, theirs = trio.socket.socketpair()
    daemon, worker = trio.SocketStream(ours), trio.SocketStream(theirs)
    server = EngineServer(engine, worker, NONCE)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run)
            d = Daemon(daemon)
            hello = await d.receive()
            assert isinstance(hello, Hello)
            await d.send(HelloAck(v=3, accept=True, max_frame=hello.max_frame, generation=1))
            yield d, hello
            nursery.cancel_scope.cancel()
    finally:
        server.compute.close()
        await daemon.aclose()
        await worker.aclose()


async def load_this_file(d: Daemon, model_ref: str) -> None:
    await d.request(Load, artifact_path=__file__, artifact_digest=THIS_FILE_SHA256, format="x", runtime_config={},
                    model_ref=model_ref)
    assert (await d.reply())[1].T == "LOADED"


def artifact(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "model.bin"
    path.write_bytes(b"weights")
    return path, hashlib.sha256(b"weights").hexdigest()


async def test_hello_carries_the_nonce_and_what_the_class_implements() -> None:
    async with session(Echo()) as (d, hello):
        assert hello.nonce == NONCE and hello.v == 3
        assert hello.engine == {"engine": "engine", "version": "0",
                                   "build_flags": ["gpuworker.stream", "gpuworker.cancel"]}
        await d.request(Ping)
        _, pong = await d.reply()
        assert pong.T == "PONG" and pong.models_loaded == []


async def test_load_embed_and_the_errors_they_answer(tmp_path: Path) -> None:
    path, digest = artifact(tmp_path)
    async with session(Embedder()) as (d, _):
        await d.request(Load, artifact_path=str(path), artifact_digest="0" * 64, format="x", runtime_config={},
                        model_ref="bad")
        assert (await d.reply())[1].code == "artifact_invalid"
        await d.request(Load, artifact_path=str(path), artifact_digest=digest.upper(), format="x", runtime_config={})
        _, loaded = await d.reply()
        assert loaded.T == "LOADED" and loaded.model_ref == "model"
        ids = np.array([1, 2, 3, 4], "<i4").tobytes()
        items = [{"id": 0, "n_tokens": 3}, {"id": 1, "n_tokens": 1}]
        await d.request(EmbedBatch, model_ref="model", pooling="mean", normalize=False, items=items, raw=ids)
        progress, vectors = await d.reply()
        assert [m.completed for m in progress] == [1] and progress[0].phase == "inference"
        assert vectors.dims == 2 and np.frombuffer(vectors.raw, "<f4").tolist() == [6, 3, 4, 1]
        await d.request(EmbedBatch, model_ref="model", pooling="cls", normalize=False, items=items, raw=ids)
        assert (await d.reply())[1].code == "invalid_request"
        await d.request(EmbedBatch, model_ref="bad", pooling="mean", normalize=False, items=items, raw=ids)
        assert (await d.reply())[1].code == "model_load_failed"


async def test_an_engine_listing_max_pooling_advertises_it_and_is_sent_it(tmp_path: Path) -> None:
    path, digest = artifact(tmp_path)
    async with session(Pooler()) as (d, hello):
        assert hello.engine["build_flags"] == [EXT_POOLING]
        await d.request(Load, artifact_path=str(path), artifact_digest=digest, format="x", runtime_config={})
        assert (await d.reply())[1].T == "LOADED"
        items = [{"id": 0, "n_tokens": 3}, {"id": 1, "n_tokens": 1}]
        await d.request(EmbedBatch, model_ref="model", pooling="max", normalize=False, items=items,
                        raw=np.array([1, 9, 3, 4], "<i4").tobytes())
        _, vectors = await d.reply()
        assert np.frombuffer(vectors.raw, "<f4").tolist() == [9, 3, 4, 1]


async def test_a_generator_streams_deltas_then_text() -> None:
    prompt = np.array([5, 6], "<i4").tobytes()
    async with session(Echo()) as (d, _):
        await d.request(Generate, model_ref="model", max_tokens=3, stream=True, raw=prompt)
        assert (await d.reply())[1].code == "model_not_loaded"
        await load_this_file(d, "model")
        await d.request(Generate, model_ref="model", max_tokens=3, stream=True, raw=prompt)
        deltas, text = await d.reply()
        assert [(m.T, m.text, m.n_gen) for m in deltas] == [
            ("TEXT_DELTA", "<5>", 1), ("TEXT_DELTA", "<6>", 2), ("TEXT_DELTA", "<5>", 3)]
        assert text.text == "<5><6><5>" and text.n_gen == 3 and text.finish_reason == "length"
        await d.request(Generate, model_ref="model", max_tokens=2, raw=prompt)
        progress, text = await d.reply()
        assert [m.T for m in progress] == ["PROGRESS", "PROGRESS"] and text.text == "<5><6>"


async def test_cancel_stops_a_running_generation_at_its_next_token() -> None:
    engine = Echo()
    engine.delay = 0.01
    async with session(engine) as (d, _):
        await load_this_file(d, "model")
        req_id = await d.request(Generate, model_ref="model", max_tokens=4000, stream=True,
                                 raw=np.array([1], "<i4").tobytes())
        first = await d.receive()
        assert first.T == "TEXT_DELTA"
        await d.send(Cancel(req_id=req_id))
        _, end = await d.reply()
        assert end.T == "ERR" and end.code == "request_cancelled" and end.req_id == req_id


async def test_plain_generate_and_shutdown() -> None:
    async with session(Plain()) as (d, _):
        await load_this_file(d, "m")
        await d.request(Generate, model_ref="m", max_tokens=100, grammar="root ::= x", raw=b"")
        assert (await d.reply())[1].code == "grammar_unsupported"
        await d.request(Generate, model_ref="m", max_tokens=100, temperature=0.5, raw=np.array([1], "<i4").tobytes())
        _, text = await d.reply()
        assert (text.text, text.n_gen, text.finish_reason, text.n_prompt) == ("done", 2, "stop", 1)
        assert np.frombuffer(text.raw, "<i4").tolist() == [7, 8]
        await d.request(Shutdown, mode="graceful")
        stopped = await d.receive()
        assert stopped.T == "WORKER_STOPPED" and stopped.reason == "graceful"
