"""Hostile HTTP over real sockets against a daemon with fake workers: every answer is typed, nothing is held
for good, no strike is counted, and /healthz keeps answering."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import trio

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import client_for, wait_until
from trio_gpuworker import Supervisor
from trio_gpuworker.daemon.http_body import DISCARD_MAX_BYTES
from trio_gpuworker.daemon.main import Daemon

HTTP = {"max_body_bytes": 16 << 20, "body_timeout_s": 0.5, "max_connections_per_client": 3}


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Daemon]]:
    async with trio.open_nursery() as nursery:
        client, daemon = await client_for(nursery, daemon_config(tmp_path, fake_command(), http=HTTP))
        async with client:
            yield client, daemon
        nursery.cancel_scope.cancel()


def no_strikes(sup: Supervisor) -> bool:
    return all(s["strikes"] == 0 and s["generation"] == 1 for s in sup.status())


async def raw(client: httpx.AsyncClient) -> trio.SocketStream:
    url = urlsplit(str(client.base_url))
    return await trio.open_tcp_stream(url.hostname, url.port)


async def read_response(stream: trio.SocketStream, within_s: float = 5.0) -> bytes:
    data = b""
    with trio.fail_after(within_s):
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
    return data


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


@pytest.mark.parametrize(("body", "code"), [
    (b'{"model":"fake-embed","input":["x\\ud800"]}', "invalid_request"),
    (b'{"model":"fake-embed","input":"\\udfff"}', "invalid_request"),
    (b'{"model":"fake-embed","query":"q\\ud800","documents":["a"]}', "invalid_request"),
    (b'{"model":"fake-embed","query":"q","documents":["a","\\ud800b"]}', "invalid_request"),
    (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json"),
    (b"[" * 200_000, "invalid_json"),
    (b'{"model":"fake-embed","input":["a"],"encoding_format":"int8"}', "invalid_request"),
    (b'{"model":"fake-embed","input":["a"],"encoding_format":""}', "invalid_request"),
    (b'{"model":"fake-embed","input":["a"],"encoding_format":["float"]}', "invalid_request"),
])
async def test_hostile_bodies_are_typed_400s(daemon: tuple[httpx.AsyncClient, Daemon], body: bytes,
                                             code: str) -> None:
    http, running = daemon
    sup = running.sup
    route = "/v1/rerank" if b"query" in body else "/v1/embeddings"
    r = await http.post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code
    assert (await http.get("/healthz")).status_code == 200 and no_strikes(sup)


async def test_head_works_where_get_does(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    http, _ = daemon
    for path in ("/healthz", "/v1/models", "/v1/lanes", "/v1/lanes/lane0"):
        get, head = await http.get(path), await http.head(path)
        assert head.status_code == get.status_code == 200, path
        assert head.content == b"" and int(head.headers["content-length"]) > 0
    assert (await http.head("/v1/embeddings")).status_code == 405


async def test_route_regex_does_not_match_a_trailing_newline(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    http, _ = daemon
    assert (await http.get("/v1/lanes/lane0")).status_code == 200
    r = await http.get("/v1/lanes/lane0%0a")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def read_whole(stream: trio.SocketStream) -> tuple[int, dict[bytes, bytes], bytes]:
    """One whole response (its body by content-length): status, headers (lower-case names), body."""
    data = await read_response(stream)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
    with trio.fail_after(5):
        while len(body) < int(headers[b"content-length"]):
            body += await stream.receive_some(65536)
    return status_of(data), headers, body


@pytest.mark.parametrize(("path", "status"), [("/v1/nope", 404), ("/healthz", 405),
                                              ("/v1/embeddings?x=1", 400)])
async def test_an_answer_before_the_body_keeps_the_connection(daemon: tuple[httpx.AsyncClient, Daemon],
                                                              path: str, status: int) -> None:
    """Refused before its body is read, a POST's body is still read and dropped: the answer leaves the
    connection usable, so a keep-alive client's next request on it is served (hypercorn used to close it
    silently right after the answer, and a request sent in that instant was lost)."""
    http, _ = daemon
    stream = await raw(http)
    body = b'{"model":"fake-embed","input":["a"]}'
    await stream.send_all(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n" % (path.encode(), len(body)))
    await trio.sleep(0.1)  # the body comes after the route was already refused
    await stream.send_all(body)
    got, headers, _ = await read_whole(stream)
    assert got == status and b"connection" not in headers
    await stream.send_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    assert (await read_whole(stream))[0] == 200
    await stream.aclose()


async def test_a_large_unread_body_closes_the_connection(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    """An unread body larger than DISCARD_MAX_BYTES is not drained: the answer comes at once and says the
    connection closes, so no client sends another request on it."""
    http, _ = daemon
    stream = await raw(http)
    await stream.send_all(b"POST /v1/nope HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n{"
                          % (DISCARD_MAX_BYTES + 1))
    got, headers, _ = await read_whole(stream)
    assert got == 404 and headers[b"connection"] == b"close"
    with trio.fail_after(2):
        while await stream.receive_some(4096):
            pass
    await stream.aclose()


async def test_idle_keep_alive_closes_after_keep_alive_s(tmp_path: Path) -> None:
    """http.keep_alive_s reaches hypercorn: a connection stays usable while requests come, and is closed once
    it has been idle that long (here 1 s; 5 s by default)."""
    async with trio.open_nursery() as nursery:
        client, _ = await client_for(nursery, daemon_config(tmp_path, fake_command(), http={"keep_alive_s": 1.0}))
        async with client:
            stream = await raw(client)
            for i in range(3):  # each well within the window: the same connection serves them all
                if i:
                    await trio.sleep(0.1)
                await stream.send_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                assert (await read_whole(stream))[0] == 200
            t0 = trio.current_time()
            with trio.fail_after(4):  # well before hypercorn's default of 5 s: the setting took effect
                while await stream.receive_some(4096):
                    pass
            assert trio.current_time() - t0 >= 0.5  # closed by the idle timer, not at once
            await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_absurd_content_length_is_refused_before_the_body(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    http, _ = daemon
    stream = await raw(http)
    await stream.send_all(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 1000000000000\r\n\r\n")
    response = await read_response(stream, within_s=1.0)  # at once, not after a body that never comes
    assert status_of(response) == 413 and b"request_too_large" in response + await stream.receive_some(4096)
    await stream.aclose()


async def test_a_stalled_body_is_cut_by_the_body_timeout(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    http, running = daemon
    sup = running.sup
    stream = await raw(http)
    await stream.send_all(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 100\r\n\r\n{\"model\":")
    t0 = trio.current_time()
    response = await read_response(stream, within_s=3.0)
    assert status_of(response) == 408 and trio.current_time() - t0 < 2.0
    with trio.fail_after(2):  # and the connection is closed
        while await stream.receive_some(4096):
            pass
    await stream.aclose()
    assert no_strikes(sup)


async def test_per_client_connection_cap(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    """Three stalled bodies hold this client's three slots: a fourth POST is refused at once (429) while
    /healthz still answers, and once the stalled ones are cut, the client is served again."""
    http, running = daemon
    api = running.api
    stalled = [await raw(http) for _ in range(3)]
    for s in stalled:
        await s.send_all(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-length: 50\r\n\r\n{")
    await wait_until(lambda: api.in_flight_from("127.0.0.1") == 3)  # all three wait for their bodies
    r = await http.post("/v1/embeddings", json={"model": MODEL, "input": ["a"]})
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_connections"
    assert (await http.get("/healthz")).status_code == 200  # probes are not counted
    for s in stalled:
        assert status_of(await read_response(s)) == 408
        await s.aclose()
    assert (await http.post("/v1/embeddings", json={"model": MODEL, "input": ["a"]})).status_code == 200


async def test_healthz_stays_fast_while_a_huge_input_is_embedded(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    """An 8 MB input is capped in characters before it is tokenized, and decoded off the loop."""
    http, running = daemon
    sup = running.sup
    huge = json.dumps({"model": MODEL, "input": ["word " * ((8 << 20) // 5)]}).encode()
    worst = 0.0
    done = trio.Event()

    async def big() -> None:
        async with httpx.AsyncClient(base_url=http.base_url, timeout=30) as c:
            r = await c.post("/v1/embeddings", content=huge, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == 256
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(big)
        while not done.is_set():
            t0 = trio.current_time()
            assert (await http.get("/healthz")).status_code == 200
            worst = max(worst, trio.current_time() - t0)
            await trio.sleep(0.005)
    print(f"/healthz worst latency during an 8 MB embedding: {worst * 1000:.1f} ms")
    assert worst < 1.0, worst  # it was 27 s
    assert no_strikes(sup)


async def test_unix_socket_file_is_removed_after_a_clean_exit(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, fake_command(), unix=True)
    async with trio.open_nursery() as nursery:
        client, _ = await client_for(nursery, cfg)
        await client.aclose()
        assert (tmp_path / "api.sock").exists()
        nursery.cancel_scope.cancel()
    assert not (tmp_path / "api.sock").exists()


async def test_engine_crashed_answer_carries_the_log_tail(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, fake_command("crash_mid_request", on_request=1), http=HTTP)
    async with trio.open_nursery() as nursery:
        http, _ = await client_for(nursery, cfg)
        async with http:
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": ["a"]})
        assert r.status_code == 503, r.text
        detail = r.json()["error"]["detail"]
        assert detail["cause"] == "crash" and "fake worker" in detail["log_tail"]  # the worker's own stderr
        nursery.cancel_scope.cancel()


async def test_admitted_bytes_are_held_until_the_lane_drained_the_reply(tmp_path: Path) -> None:
    """A caller that times out (504) leaves its batch to the lane; the model's admission budget still counts
    those bytes until the reply has drained, then releases them."""
    cfg = daemon_config(tmp_path, fake_command("slow", delay=0.6, on_request=0), timeout_s=0.2, http=HTTP)
    async with trio.open_nursery() as nursery:
        http, daemon = await client_for(nursery, cfg)
        sup = daemon.sup
        scheduler = sup.scheduler
        assert scheduler is not None
        lane = next(iter(sup.lanes.values()))  # type: ignore[attr-defined]
        async with http:
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": ["a", "b"]})
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
        assert scheduler.queued_bytes[MODEL] > 0 and lane.state.value == "busy"  # still draining
        await wait_until(lambda: scheduler.queued_bytes[MODEL] == 0, within_s=2.0)
        assert scheduler.queued[MODEL] == 0 and no_strikes(sup)
        nursery.cancel_scope.cancel()


async def test_a_large_answer_is_encoded_off_the_loop_and_complete(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, fake_command(), http={**HTTP, "max_inputs": 5000})
    async with trio.open_nursery() as nursery:
        http, _ = await client_for(nursery, cfg)
        async with http:
            texts = [f"t{i}" for i in range(4100)]  # 4100 x 4 floats: over the inline limit
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": texts})
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        data = r.json()["data"]
        assert [d["index"] for d in data] == list(range(4100))
        assert [d["embedding"][2] for d in data[:3]] == [0.0, 1.0, 2.0]  # the fake's row ids: input order kept
        nursery.cancel_scope.cancel()


async def test_rerank_of_2048_long_documents_with_a_1_mib_frame(tmp_path: Path) -> None:
    """A reproduction over HTTP: one 1.6 MB RERANK frame once stopped the daemon (exit 1)."""
    import dataclasses

    cfg = daemon_config(tmp_path, fake_command(), http=HTTP)
    cfg = dataclasses.replace(cfg, supervisor=dataclasses.replace(cfg.supervisor, max_frame=1 << 20))
    words = " ".join(f"word{i % 97}" for i in range(200))
    async with trio.open_nursery() as nursery:
        http, daemon = await client_for(nursery, cfg)
        sup = daemon.sup
        async with http:
            r = await http.post("/v1/rerank", json={"model": MODEL, "query": "q",
                                                    "documents": [f"{i} {words}" for i in range(2048)]})
            assert r.status_code == 200, r.text
            assert len(r.json()["results"]) == 2048
            assert (await http.get("/healthz")).status_code == 200 and no_strikes(sup)
        nursery.cancel_scope.cancel()
