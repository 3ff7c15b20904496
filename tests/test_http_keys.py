"""API keys: where they come from, the configurations refused without them, and what a TCP request needs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import openai
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.config import LANE_TABLE, MINILM_TABLE, MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import client_for
from trio_gpuworker import ConfigError
from trio_gpuworker.daemon.config import parse_config
from trio_gpuworker.daemon.http_auth import bearer_token, challenge, key_matches, load_api_keys

KEY, OTHER_KEY = "k" * 16 + "-first", "AbC0123456789+/=="
REMOTE = "[http]\nlisten = '0.0.0.0:8421'\nallow_remote = true\n"


def parse(tmp_path: Path, text: str, env: dict[str, str] | None = None):
    return parse_config(text + MINILM_TABLE + LANE_TABLE, tmp_path, env or {})


def test_keys_from_the_file_and_the_environment(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text(f"# rotated 2026-12\n{KEY}\n\n  {OTHER_KEY}  \n")
    cfg = parse(tmp_path, REMOTE + "api_keys_file = 'keys'\n")  # relative to the working directory
    assert key_matches(KEY, cfg.http.api_keys) and key_matches(OTHER_KEY, cfg.http.api_keys)
    assert not key_matches(KEY[:-1], cfg.http.api_keys) and not key_matches(None, cfg.http.api_keys)
    assert KEY not in repr(cfg)  # only digests are kept, and not shown
    env = {"GPUWORKER_API_KEYS": f"{OTHER_KEY}, second-key-abcdefghij third-key-abcdefghijk"}
    both = parse(tmp_path, REMOTE + "api_keys_file = 'keys'\n", env).http.api_keys
    assert len(both) == 4 and key_matches("third-key-abcdefghijk", both)
    assert len(parse(tmp_path, REMOTE, env).http.api_keys) == 3


@pytest.mark.parametrize(("text", "env", "message"), [
    (REMOTE, {}, "http.allow_remote: a listener other hosts can reach needs API keys"),
    (REMOTE + "api_keys_file = 'missing'\n", {}, "http.api_keys_file: cannot read"),
    (REMOTE + "api_keys_file = 'empty'\n", {}, "holds no key"),
    (REMOTE, {"GPUWORKER_API_KEYS": "short"}, "key 1 has 5 characters; at least 16"),
    (REMOTE, {"GPUWORKER_API_KEYS": "a" * 16 + ",badkey\u00e9" + "x" * 16}, "key 2 holds characters"),
    (REMOTE + "insecure_no_auth = true\n", {"GPUWORKER_API_KEYS": KEY}, "http.insecure_no_auth: API keys are"),
    ("[http]\napi_keys = ['x']\n", {}, "http.api_keys: keys are not written in the configuration"),
    ("[http]\nopen_routes = ['/v1/embeddings']\n", {}, "http.open_routes: expected a list of routes"),
    ("[http]\nlisten = '0.0.0.0:1'\n", {}, "is not a loopback address"),
])
def test_refused(tmp_path: Path, text: str, env: dict[str, str], message: str) -> None:
    (tmp_path / "empty").write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        parse(tmp_path, text, env)


def test_insecure_no_auth_says_it_explicitly(tmp_path: Path) -> None:
    cfg = parse(tmp_path, REMOTE + "insecure_no_auth = true\n")
    assert cfg.http.allow_remote and cfg.http.insecure_no_auth and not cfg.http.api_keys
    # keys on a loopback listener are fine too
    assert parse(tmp_path, "", {"GPUWORKER_API_KEYS": KEY}).http.api_keys


def test_challenge() -> None:
    assert challenge(False) == 'Bearer realm="gpuworkerd"'
    assert challenge(True) == 'Bearer realm="gpuworkerd", error="invalid_token"'


async def test_tcp_needs_a_key_the_probes_and_the_unix_socket_do_not(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, fake_command(), unix=True)
    keys = load_api_keys("", tmp_path, {"GPUWORKER_API_KEYS": KEY})
    cfg = dataclasses.replace(cfg, http=dataclasses.replace(cfg.http, api_keys=keys))
    body = {"model": MODEL, "input": "x"}
    async with trio.open_nursery() as nursery:
        http, daemon = await client_for(nursery, cfg)
        async with http:
            r = await http.post("/v1/embeddings", json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
            assert r.headers["www-authenticate"] == 'Bearer realm="gpuworkerd"'
            r = await http.post("/v1/embeddings", json=body, headers={"authorization": f"Bearer {KEY}x"})
            assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"]
            r = await http.post("/v1/embeddings", json=body, headers={"authorization": f"Basic {KEY}"})
            assert r.status_code == 401
            r = await http.post("/v1/embeddings", json=body, headers={"authorization": f"bearer {KEY}"})
            assert r.status_code == 200, r.text  # the scheme is case-insensitive, and the connection kept
            for path in ("/v1/models", "/v1/lanes", "/nope"):
                assert (await http.get(path)).status_code == 401, path
            for path in ("/livez", "/readyz", "/healthz", "/metrics"):
                assert (await http.get(path)).status_code == 200, path
            transport = httpx.AsyncHTTPTransport(uds=cfg.http.unix_socket)
            async with httpx.AsyncClient(base_url="http://gpuworkerd", transport=transport, timeout=30) as local:
                assert (await local.post("/v1/embeddings", json=body)).status_code == 200  # guarded by its mode

            # the openai client sends its api_key as a bearer token
            def call(key: str) -> object:
                client = openai.OpenAI(base_url=daemon.binds[0] + "/v1", api_key=key, max_retries=0, timeout=30)
                try:
                    return client.embeddings.create(model=MODEL, input="x")
                except openai.AuthenticationError as exc:
                    return exc
                finally:
                    client.close()

            assert len((await trio.to_thread.run_sync(call, KEY)).data) == 1
            assert (await trio.to_thread.run_sync(call, "not-the-key-0123456789")).status_code == 401
        nursery.cancel_scope.cancel()


async def test_open_routes_can_be_closed(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, fake_command(), http={"open_routes": ("/livez",)})
    cfg = dataclasses.replace(cfg, http=dataclasses.replace(
        cfg.http, api_keys=load_api_keys("", tmp_path, {"GPUWORKER_API_KEYS": KEY})))
    async with trio.open_nursery() as nursery:
        http, _ = await client_for(nursery, cfg)
        async with http:
            assert (await http.get("/livez")).status_code == 200
            for path in ("/readyz", "/healthz", "/metrics"):
                assert (await http.get(path)).status_code == 401, path
                r = await http.get(path, headers={"authorization": f"Bearer {KEY}"})
                assert r.status_code == 200, path
        nursery.cancel_scope.cancel()


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([b"authorization", b"Authorization", b"x-api-key"]) | st.binary(max_size=8),
                          st.binary(max_size=40) | st.sampled_from([f"Bearer {KEY}".encode(), b"Bearer ", b"bearer"])),
                max_size=3))
def test_any_authorization_header_is_answered(headers: list[tuple[bytes, bytes]]) -> None:
    """Whatever the headers, the check answers (no exception) and admits exactly the configured key."""
    digests = load_api_keys("", Path.cwd(), {"GPUWORKER_API_KEYS": KEY})
    token = bearer_token(headers)
    assert key_matches(token, digests) == (token == KEY)
