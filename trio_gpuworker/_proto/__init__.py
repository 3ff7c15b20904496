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
    "INTERMEDIATE",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "REQUESTS",
    "RING_ABI",
    "RING_HEADER_LEN",
    "SCHEMAS",
    "TERMINAL",
    "TRANSITIONS",
    "WORKER",
    "Connection",
    "Fault",
    "FrameDecoder",
    "Handshake",
    "HandshakeRules",
    "HandshakeState",
    "Lease",
    "LeaseState",
    "LeaseStats",
    "LeaseTable",
    "Message",
    "NeverInstalled",
    "ProgressValidator",
    "Proof",
    "Quiesced",
    "Reaped",
    "ReplyKind",
    "RequestTracker",
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
