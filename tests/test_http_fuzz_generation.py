"""Hypothesis fuzzing of the generation routes' fields (sampling, stop, logprobs, stream, stream_options) against
a scripted worker that advertises every protocol extension and streams, so cases reach SSE and the worker:
0 answers with status 500, 0 strikes, and valid bodies answered."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.config import daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import client_for
from tests.support.http_fuzz import EXAMPLES, JSON, PER_EXAMPLE, RAW, SAMPLING, TEXT, asgi_status, encode
from trio_gpuworker.daemon.config import DEFAULT_LM

CASES = max(PER_EXAMPLE, EXAMPLES // 10)  # each valid case is a worker round trip, streamed or not
FIELDS = {**SAMPLING, "max_tokens": st.integers(-1, 6), "top_logprobs": st.integers(-1, 6),
          "temperature": st.floats(0, 2) | SAMPLING["temperature"],
          "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}) | JSON}
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": TEXT}),
                    min_size=1, max_size=3)
BODIES = {
    "/v1/completions": st.fixed_dictionaries({"model": st.just(DEFAULT_LM), "prompt": TEXT.filter(bool)},
                                             optional={k: v | JSON for k, v in FIELDS.items()}),
    "/v1/chat/completions": st.fixed_dictionaries({"model": st.just(DEFAULT_LM), "messages": MESSAGES},
                                                  optional={k: v | JSON for k, v in FIELDS.items()}),
}


@pytest.mark.parametrize("route", sorted(BODIES))
async def test_fuzz_generation_fields(tmp_path: Path, route: str) -> None:
    cfg = daemon_config(tmp_path, fake_command(), timeout_s=5.0, http={"max_body_bytes": 1 << 20},
                        lm=fake_command(stream_token_s=1e-4))
    statuses: Counter[int] = Counter()
    async with trio.open_nursery() as nursery:
        client, daemon = await client_for(nursery, cfg)
        await client.aclose()
        app = daemon.api.listener(admin=True)

        @settings(max_examples=max(1, CASES // PER_EXAMPLE), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(BODIES[route] | RAW, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
        def run(bodies: list[Any]) -> None:
            for body in bodies:
                statuses[trio.from_thread.run(asgi_status, app, "POST", route, encode(body))] += 1

        await trio.to_thread.run_sync(run)
        strikes = [(s["strikes"], s["generation"]) for s in daemon.sup.status()]  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()
    print(route, dict(statuses))
    assert statuses[500] == 0, dict(statuses)
    assert sum(statuses.values()) >= CASES * 0.9
    assert [s for s, _ in strikes] == [0, 0]  # nobody struck, whatever was sent
    assert statuses[200] > CASES // 20, dict(statuses)  # cases reached the worker, streamed or not
