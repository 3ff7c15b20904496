"""Daemon logging: a plain, journald-friendly default and a JSON-lines option, both with lane fields.

Records may carry `lane_id`, `generation` and `stream` (worker stdout/stderr) in `extra`; both formats show
them. Under systemd (stderr is the journal, `$JOURNAL_STREAM` names it) the plain format drops its own
timestamp and prefixes each line with its syslog priority (`<4>`), which journald turns into the entry's
priority; elsewhere it carries an ISO timestamp.

    plain:  <6>trio_gpuworker.worker_output [embed-0 g3 stderr] loading weights
    json:   {"ts": "2026-01-02T03:04:05.678Z", "level": "info", "logger": "...", "msg": "...",
             "lane_id": "embed-0", "generation": 3, "stream": "stderr"}
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

FIELDS = ("lane_id", "generation", "stream")
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _iso(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def _tag(record: logging.LogRecord) -> str:
    lane, gen, stream = (getattr(record, f, None) for f in FIELDS)
    if lane is None:
        return ""
    parts = [str(lane)] + ([f"g{gen}"] if gen is not None else []) + ([str(stream)] if stream else [])
    return f"[{' '.join(parts)}] "


class PlainFormatter(logging.Formatter):
    def __init__(self, journald: bool = False) -> None:
        super().__init__()
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.name}: {_tag(record)}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if self.journald:
            prio = _PRIORITY.get(record.levelno, 6)
            # journald reads the prefix of each line: keep multi-line tracebacks at the record's priority
            return "\n".join(f"<{prio}>{line}" for line in text.splitlines() or [""])
        return f"{_iso(record.created)} {record.levelname} {text}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": _iso(record.created), "level": record.levelname.lower(), "logger": record.name,
                               "msg": record.getMessage()}
        for f in FIELDS:
            value = getattr(record, f, None)
            if value is not None:
                out[f] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def under_journald(env: Mapping[str, str], stream: TextIO) -> bool:
    """True when `stream` is the journal's stream socket ($JOURNAL_STREAM is "device:inode" of it)."""
    want = env.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return bool(want) and want == f"{st.st_dev}:{st.st_ino}"


def setup_logging(fmt: str = "plain", level: str = "info", stream: TextIO | None = None,
                  env: Mapping[str, str] | None = None) -> logging.Handler:
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json"
                         else PlainFormatter(journald=under_journald(os.environ if env is None else env, stream)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS[level])
    for noisy in ("hypercorn.error", "hypercorn.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, LEVELS[level]))
    return handler
