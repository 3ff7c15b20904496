"""Fault plans: what a fake engine does wrong, written as data (docs/testing.md, 'Fault plans'). One plan drives a
fake engine run as a real process (`FaultPlan.command()`, a lane's worker_command) and one run in-process under a
mock clock (`SimLauncher`). Only the standard library here: the process fake imports this and starts as fast as
plain Python."""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# what a fake does instead of its handshake (crash_before_hello: it exits 3 before it connects)
HANDSHAKE_FAULTS = ("crash_before_hello", "garbage_hello", "wrong_nonce", "v2_hello", "frame_before_hello",
                    "frame_behind_hello", "oversize_hello")
# what it does instead of answering a serving request (EMBED_BATCH, RERANK, GENERATE; in-process EXECUTE_STEP too)
REQUEST_FAULTS = ("crash_mid_request", "crash_between_header_and_raw", "hang_silent", "hang_after_progress",
                  "hang_sigstop", "stop_reading", "garbage", "oversize_length", "regressing_progress", "wrong_req_id",
                  "flood_stderr", "slow", "exit_after_reply", "stop_after_reply")
# what `fault_rate` draws from: each ends its request with a typed error at the caller, never a hang of the caller
RANDOM_FAULTS = ("crash_mid_request", "crash_between_header_and_raw", "hang_silent", "garbage", "wrong_req_id",
                 "regressing_progress")
EVERY = 0  # a `faults` key: every serving request
FAKE_WORKER = Path(__file__).resolve().parent / "_fake_worker.py"  # the process fake, run as a script


@dataclass(frozen=True)
class FaultPlan:
    """What one fake engine does wrong, and when. The default plan is a healthy fake: it loads any artifact (dims 4)
    and answers every request with content the caller can check (docs/testing.md, 'What a fake answers')."""

    # the n-th serving request (from 1) -> its fault (REQUEST_FAULTS); key 0 (EVERY): every serving request
    faults: Mapping[int, str] = field(default_factory=dict)
    fault_rate: float = 0.0  # besides `faults`, the chance that a serving request draws one of RANDOM_FAULTS
    seed: int | None = None  # the draws' seed
    handshake: str | None = None  # one of HANDSHAKE_FAULTS, instead of a proper HELLO
    crash_in_load: int | None = None  # exit during the n-th LOAD (0: every LOAD), after its first PROGRESS
    load_s: float = 0.0  # how long each LOAD takes, silent
    first_load_s: float | None = None  # the first LOAD's, when it differs
    slow_s: float = 1.0  # how long a `slow` request takes before its reply
    progress_every_s: float | None = None  # a `slow` request's PROGRESS interval (None: silent, a hang to catch)
    ignore_sigterm: bool = False  # only the SIGKILL after the kill grace ends it
    burst: bool = False  # a GENERATE's PROGRESS comes as one burst of replies in one write (in-process)
    generations: frozenset[int] | None = None  # the worker generations that follow the plan (None: all)
    once_file: Path | None = None  # misbehave only while this file does not exist, and create it then

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults.values() if f not in REQUEST_FAULTS]
        if unknown or (self.handshake is not None and self.handshake not in HANDSHAKE_FAULTS):
            raise ValueError(f"unknown fault {(unknown or [self.handshake])[0]!r}")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault_rate {self.fault_rate} is not a probability")
        object.__setattr__(self, "faults", dict(self.faults))
        if self.generations is not None:
            object.__setattr__(self, "generations", frozenset(self.generations))

    def for_generation(self, generation: int) -> FaultPlan:
        """The plan worker generation `generation` follows: this one, or a healthy one if it is not among
        `generations`."""
        if self.generations is None or generation in self.generations:
            return self
        return FaultPlan()

    def request_fault(self, n: int, rng: random.Random) -> str | None:
        """The fault of the n-th serving request (from 1), if any: scripted first, else a random draw."""
        fault = self.faults.get(n, self.faults.get(EVERY))
        if fault is None and self.fault_rate and rng.random() < self.fault_rate:
            fault = rng.choice(RANDOM_FAULTS)
        return fault

    def load_delay(self, n: int) -> float:
        """How long the n-th LOAD (from 1) takes."""
        return self.first_load_s if n == 1 and self.first_load_s is not None else self.load_s

    def crashes_in_load(self, n: int) -> bool:
        """Whether the worker exits during its n-th LOAD (from 1)."""
        return self.crash_in_load is not None and self.crash_in_load in (EVERY, n)

    def claim(self) -> bool:
        """May this worker misbehave now? Always without a `once_file`; with one, only the first to create it."""
        if self.once_file is None:
            return True
        try:
            os.close(os.open(self.once_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def to_json(self) -> str:
        """The plan as the process fake's `--plan` takes it."""
        fields = asdict(self)
        fields["faults"] = {str(n): f for n, f in self.faults.items()}
        fields["generations"] = sorted(self.generations) if self.generations is not None else None
        fields["once_file"] = str(self.once_file) if self.once_file is not None else None
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        """The plan `to_json` wrote."""
        fields: dict[str, Any] = json.loads(text)
        fields["faults"] = {int(n): f for n, f in fields.get("faults", {}).items()}
        if fields.get("generations") is not None:
            fields["generations"] = frozenset(fields["generations"])
        if fields.get("once_file") is not None:
            fields["once_file"] = Path(fields["once_file"])
        return cls(**fields)

    def command(self, python: str = sys.executable) -> tuple[str, ...]:
        """A lane's `worker_command` for a fake engine process that follows this plan (the lane appends
        `--socket PATH --nonce HEX`)."""
        return (python, str(FAKE_WORKER), "--plan", self.to_json())


__all__ = ["EVERY", "FAKE_WORKER", "HANDSHAKE_FAULTS", "RANDOM_FAULTS", "REQUEST_FAULTS", "FaultPlan"]
