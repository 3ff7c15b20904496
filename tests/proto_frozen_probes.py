"""Values to feed every field check of the old and the derived message tables: each must answer alike."""

from __future__ import annotations

from typing import Any

ENGINE = {"engine": "tinygrad", "version": "0.14.0", "build_flags": ["x"]}
HANDLE = {"worker_generation": 1, "id": 2}
STEP_INPUT = {"port_id": "in", "object_id": 1, "sequence": 0, "device_handle": HANDLE}
STEP_OUTPUT = {"port_id": "out", "ring_id": 1, "object_id": 1, "sequence": 0, "extent": 8, "flags": 0}

PROBES: list[Any] = [
    0, 1, -1, (1 << 32) - 1, 1 << 32, (1 << 64) - 1, 1 << 64, True, False, 1.5, float("inf"), None,
    "", "x", "graceful", "abort_in_flight", "fatal", "mean", "cls", "stop", "length", "setup", "inference",
    "control", "ingress", "egress", "edge_stopped", "ring_faulted", "worker_shutdown",
    [], [1], ["a"], [None], {}, {"a": 1}, {1: 2}, [{"a": 1}], [[1, 2, 3, 4]], [[1, 2, 3]], [[1, 2, 3, -4]],
    ENGINE, {**ENGINE, "extra": 1}, {"engine": "tinygrad", "version": "0.14.0"},
    [{"id": 1, "n_tokens": 2}], [{"id": 1}], [{"n_tokens": 1}], [{"n_tokens": -1}],
    HANDLE, {"worker_generation": 1}, {"offset": 0, "header_len": 64, "capacity": 4096}, {"offset": 0},
    [STEP_INPUT], [{**STEP_INPUT, "device_handle": {}}], [STEP_OUTPUT], [{**STEP_OUTPUT, "flags": True}],
]
