"""The request on one control connection: req_ids, which replies belong to it, and the progress rules.

Both sides use it. The daemon's lane opens a request with `begin`; its socket reader classifies every reply
frame with `classify` as it reads it (what is salvaged once a worker is gone was classified then) and learns
from each verdict whether the silence window is renewed. The worker asks `is_request` for every frame it
reads. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .._errors import LocalProtocolError, ProgressViolation, UnexpectedFrame
from ._messages import Err, Generate, Progress, TextDelta
from ._progress import ProgressValidator
from ._schema import INTERMEDIATE, TERMINAL
from ._wire import WireMessage

REQUESTS = frozenset(TERMINAL)  # every message that opens a request, mapped to its terminal replies


def is_request(t: str) -> bool:
    """True when `t` opens a request (and so carries a req_id that a terminal reply will close)."""
    return t in REQUESTS


class Kind(Enum):
    PROGRESS = "progress"  # PROGRESS for the open request; `renews` says whether it renews the watchdog
    INTERMEDIATE = "intermediate"  # a reply that precedes the terminal one (OBJECT_PRODUCED of EXECUTE_STEP)
    TERMINAL = "terminal"  # the reply that ends the open request
    ERROR = "error"  # ERR: ends the open request with a worker error


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    phase: str | None = None
    renews: bool = False


@dataclass(frozen=True, slots=True)
class Reply:
    """How a request ended on the wire: its terminal reply (or ERR) and the intermediate replies that came before
    it, in order (an EXECUTE_STEP's OBJECT_PRODUCED)."""

    msg: WireMessage
    extras: tuple[WireMessage, ...] = ()


@dataclass(frozen=True)
class OpenRequest:
    t: str
    req_id: int
    intermediates: int | None = None  # how many intermediate replies it may have (an EXECUTE_STEP: its outputs)


class RequestTracker:
    """One request open at a time; req_ids increase and are never reused on this tracker.

    A PROGRESS frame renews the watchdog only when it reports completed work (`completed > 0`): a count of
    zero may announce a phase, but timer ticks and announcements never keep a silent worker alive.
    """

    def __init__(self) -> None:
        self.last_req_id = 0
        self.open: OpenRequest | None = None
        self._progress: ProgressValidator | None = None
        self._delta_tokens = 0  # n_gen of the open GENERATE's last TEXT_DELTA
        self._intermediates = 0  # intermediate replies the open request has had

    def begin(self, t: str, phase: str = "setup", intermediates: int | None = None) -> int:
        """Open a request of type `t`; returns its req_id. `intermediates` bounds the intermediate replies it may
        have (one OBJECT_PRODUCED per output of an EXECUTE_STEP): one more is the worker's fault."""
        if self.open is not None:
            raise LocalProtocolError(f"{t} while {self.open.t} (req_id {self.open.req_id}) is still open")
        if not is_request(t):
            raise LocalProtocolError(f"{t} is not a request")
        self.last_req_id += 1
        self.open = OpenRequest(t, self.last_req_id, intermediates)
        self._progress = ProgressValidator(self.last_req_id, phase)
        self._delta_tokens = self._intermediates = 0
        return self.last_req_id

    def abort(self) -> None:
        """The request was never written (it failed local validation): no reply will come for it."""
        self.open = self._progress = None

    @property
    def phase(self) -> str | None:
        return self._progress.phase if self._progress is not None else None

    def classify(self, msg: WireMessage) -> Verdict:
        """Classify a reply frame (one with a req_id) against the open request; a terminal verdict closes it.

        Raises UnexpectedFrame or ProgressViolation (both RemoteProtocolError) when the worker broke the rules.
        """
        req, req_id = self.open, getattr(msg, "req_id", None)
        if req is None:
            raise UnexpectedFrame(f"{msg.T} for req_id {req_id} while no request is open")
        if isinstance(msg, Progress):
            assert self._progress is not None
            before = self._progress.completed
            phase = self._progress.accept(msg)
            return Verdict(Kind.PROGRESS, phase, renews=msg.completed > (before or 0))
        if req_id != req.req_id:
            raise UnexpectedFrame(f"{msg.T} for req_id {req_id} while {req.req_id} is current")
        if isinstance(msg, TextDelta) and req.t == Generate.T:
            # streamed text is completed work, like PROGRESS: it renews the window when it adds tokens
            if msg.n_gen <= self._delta_tokens:
                raise ProgressViolation(f"TEXT_DELTA n_gen {msg.n_gen} does not exceed {self._delta_tokens}")
            self._delta_tokens = msg.n_gen
            return Verdict(Kind.PROGRESS, self.phase, renews=True)
        if msg.T in INTERMEDIATE.get(req.t, ()):
            self._intermediates += 1
            if req.intermediates is not None and self._intermediates > req.intermediates:
                raise UnexpectedFrame(f"{msg.T} number {self._intermediates} for a {req.t} with "
                                      f"{req.intermediates} outputs")
            return Verdict(Kind.INTERMEDIATE)
        if isinstance(msg, Err):
            self.abort()
            return Verdict(Kind.ERROR)
        if msg.T in TERMINAL[req.t]:
            self.abort()
            return Verdict(Kind.TERMINAL)
        raise UnexpectedFrame(f"{msg.T} is not a reply to {req.t}")
