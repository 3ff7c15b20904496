"""Strikes and timed quarantine, fed timestamps (never reads a clock)."""

from __future__ import annotations

from enum import Enum


class Fault(Enum):
    CRASH = "crash"
    HANG = "hang"
    PROTOCOL = "protocol"


class StrikePolicy:
    """Consecutive genuine faults quarantine the lane for `cooldown_s`.

    Only a drained successful serving reply calls `success()`; LOAD, reload, PING and setup do
    not. Kills the daemon ordered are not faults and never reach `strike()`. A reload or unload `lift()`s a
    quarantine; it does not forgive strikes outside one.
    """

    def __init__(self, max_strikes: int = 2, cooldown_s: float = 600.0) -> None:
        if max_strikes < 1 or cooldown_s < 0:
            raise ValueError("max_strikes must be >= 1 and cooldown_s >= 0")
        self.max_strikes = max_strikes
        self.cooldown_s = cooldown_s
        self.strikes = 0
        self.quarantined_until: float | None = None
        self.last_fault: Fault | None = None

    def strike(self, fault: Fault, now: float) -> bool:
        """Count one strike; True if this strike quarantined the lane."""
        self.cooldown_remaining(now)  # a lapsed quarantine ends here, even if nobody asked
        self.strikes += 1
        self.last_fault = fault
        if self.strikes >= self.max_strikes and self.quarantined_until is None:
            self.quarantined_until = now + self.cooldown_s
            return True
        return False

    def success(self) -> None:
        self.strikes = 0

    def clear(self) -> None:
        """The cool-down is over: a fresh start with zero strikes."""
        self.strikes = 0
        self.quarantined_until = None

    def lift(self) -> bool:
        """Unload or reload of the lane lifts a quarantine at once (the fresh worker starts with zero strikes).
        Outside a quarantine it forgives nothing: only drained serving work clears strikes. True if it lifted one."""
        if self.quarantined_until is None:
            return False
        self.clear()
        return True

    def cooldown_remaining(self, now: float) -> float | None:
        """Seconds of quarantine left, or None. An expired quarantine resets to zero strikes."""
        if self.quarantined_until is None:
            return None
        if now >= self.quarantined_until:
            self.clear()
            return None
        return self.quarantined_until - now
