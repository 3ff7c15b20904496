"""Log formats: plain (journald-aware) and JSON lines, both carrying lane and generation."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_gpuworker.daemon.logs import JsonFormatter, PlainFormatter, setup_logging, under_journald
from trio_gpuworker.supervisor import LogRing


def record(msg: str, level: int = logging.INFO, **extra: object) -> logging.LogRecord:
    r = logging.LogRecord("trio_gpuworker.lane", level, __file__, 1, msg, (), None)
    r.__dict__.update(extra)
    return r


def test_plain_format_tags_lane_and_generation() -> None:
    line = PlainFormatter().format(record("worker exited", lane_id="embed-0", generation=3))
    assert line.endswith("INFO trio_gpuworker.lane: [embed-0 g3] worker exited")
    assert line[:4].isdigit() and "T" in line.split()[0]  # an ISO timestamp off the journal
    worker = PlainFormatter().format(record("loading", lane_id="gen-0", generation=1, stream="stderr"))
    assert "[gen-0 g1 stderr] loading" in worker
    assert PlainFormatter().format(record("no lane")).endswith("trio_gpuworker.lane: no lane")


def test_plain_format_under_journald_has_priorities_and_no_timestamp() -> None:
    f = PlainFormatter(journald=True)
    assert f.format(record("hi", lane_id="l", generation=2)) == "<6>trio_gpuworker.lane: [l g2] hi"
    assert f.format(record("bad", logging.ERROR)) == "<3>trio_gpuworker.lane: bad"
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        r = record("failed", logging.WARNING)
        r.exc_info = sys.exc_info()
    lines = f.format(r).splitlines()
    assert len(lines) > 2 and all(line.startswith("<4>") for line in lines)


def test_json_format() -> None:
    out = json.loads(JsonFormatter().format(record("worker exited", logging.WARNING, lane_id="embed-0",
                                                   generation=3, stream="stdout")))
    assert out["level"] == "warning" and out["logger"] == "trio_gpuworker.lane" and out["msg"] == "worker exited"
    assert out["lane_id"] == "embed-0" and out["generation"] == 3 and out["stream"] == "stdout"
    assert out["ts"].endswith("Z")


def test_journald_detection(tmp_path: Path) -> None:
    a, b = socket.socketpair()
    with a, b, os.fdopen(a.fileno(), "w", closefd=False) as stream:
        st = os.fstat(a.fileno())
        assert under_journald({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, stream)
        assert not under_journald({"JOURNAL_STREAM": "1:2"}, stream)
        assert not under_journald({}, stream)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_worker_output_is_tagged_by_lane_and_generation(restore_logging: None) -> None:
    """The lane's log ring logs each line of a worker's stdout/stderr with its lane, generation and stream."""
    stream = io.StringIO()
    setup_logging("json", "info", stream=stream, env={})
    LogRing("embed-0").feed("stderr", 4, b"compiling kernels\npartial")
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(r["msg"], r["lane_id"], r["generation"], r["stream"]) for r in records] == [
        ("compiling kernels", "embed-0", 4, "stderr")]
    setup_logging("plain", "warning", stream=stream, env={})
    assert logging.getLogger().level == logging.WARNING
