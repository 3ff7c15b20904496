"""Sans-I/O core: framing, messages, handshake, requests and progress rules, strike/quarantine policy, leases.

Nothing here imports trio, socket, os or tinygrad; time is passed in, never read.
"""

from ._connection import CLOSED, NEED_DATA, Connection, decode_control
from ._framing import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame, frame_prefix
from ._handshake import PROTOCOL_VERSION, RING_ABI, TRANSITIONS, Handshake, HandshakeRules, HandshakeState, hello_fields
from ._leases import (
    ALIGN,
    RING_HEADER_LEN,
    Lease,
    LeaseState,
    LeaseStats,
    LeaseTable,
    NeverInstalled,
    Proof,
    Quiesced,
    Reaped,
    Ticket,
)
from ._lifecycle import LaneLifecycle
from ._lifecycle_parts import (
    RELOAD,
    SERVING,
    Abort,
    Backoff,
    Crashed,
    Effect,
    Finish,
    Kill,
    Outcome,
    Role,
    Send,
    Spawn,
)
from ._lifecycle_parts import Ticket as LaneTicket
from ._lifecycle_table import GENERATION_TRANSITIONS, LANE_TRANSITIONS, GenState, LaneState, LifecycleError
from ._message import Message
from ._progress import ProgressValidator
from ._requests import REQUESTS, RequestTracker, Verdict, is_request
from ._requests import Kind as ReplyKind
from ._ring_messages import INTERMEDIATE
from ._schema import BOTH, DAEMON, SCHEMAS, TERMINAL, WORKER, Spec, check_fields
from ._strikes import Fault, StrikePolicy

__all__ = [
    "ALIGN",
    "BOTH",
    "CLOSED",
    "DAEMON",
    "DEFAULT_MAX_FRAME",
    "GENERATION_TRANSITIONS",
    "INTERMEDIATE",
    "LANE_TRANSITIONS",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "RELOAD",
    "REQUESTS",
    "RING_ABI",
    "RING_HEADER_LEN",
    "SCHEMAS",
    "SERVING",
    "TERMINAL",
    "TRANSITIONS",
    "WORKER",
    "Abort",
    "Backoff",
    "Connection",
    "Crashed",
    "Effect",
    "Fault",
    "Finish",
    "FrameDecoder",
    "GenState",
    "Handshake",
    "HandshakeRules",
    "HandshakeState",
    "Kill",
    "LaneLifecycle",
    "LaneState",
    "LaneTicket",
    "Lease",
    "LeaseState",
    "LeaseStats",
    "LeaseTable",
    "LifecycleError",
    "Message",
    "NeverInstalled",
    "Outcome",
    "ProgressValidator",
    "Proof",
    "Quiesced",
    "Reaped",
    "ReplyKind",
    "RequestTracker",
    "Role",
    "Send",
    "Spawn",
    "Spec",
    "StrikePolicy",
    "Ticket",
    "Verdict",
    "check_fields",
    "decode_control",
    "encode_frame",
    "frame_prefix",
    "hello_fields",
    "is_request",
]
