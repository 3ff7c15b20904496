"""When the background tuner's BEAM search may run: a pure policy, fed whether serving lanes are busy and the time.

BEAM picks kernels by timing them, so a search that shares the cores with requests both slows them and times
its candidates on a loaded machine. The tuner's worker is paused (SIGSTOP to its process group) while any lane
has a request open, but never for longer than MAX_PAUSE_S at a time and always runs at least MIN_RUN_S after a
pause: under a steady load the search still finishes (and its LOAD watchdog still hears PROGRESS), at half speed.
tinygrad times each candidate several times and keeps the fastest, so a sample a request shared is outvoted.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE_S = 1.0  # the longest one pause lasts under load
MIN_RUN_S = 1.0  # the search runs at least this long between two pauses
POLL_S = 0.02  # how often the daemon looks at its lanes (the pause begins within this of a request)


@dataclass
class Pacer:
    max_pause_s: float = MAX_PAUSE_S
    min_run_s: float = MIN_RUN_S
    paused_since: float | None = None
    running_since: float = float("-inf")
    paused_s: float = 0.0  # in all, for the report

    def paused(self, busy: bool, now: float) -> bool:
        """Whether the search should be paused now."""
        if self.paused_since is not None:
            if busy and now - self.paused_since < self.max_pause_s:
                return True
            self.paused_s += now - self.paused_since
            self.paused_since, self.running_since = None, now
            return False
        if busy and now - self.running_since >= self.min_run_s:
            self.paused_since = now
            return True
        return False


__all__ = ["MAX_PAUSE_S", "MIN_RUN_S", "POLL_S", "Pacer"]
