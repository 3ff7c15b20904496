"""Sans-I/O core: framing, messages, handshake, progress rules, strike/quarantine policy.

Nothing here imports trio, socket, os or tinygrad; time is passed in, never read.
"""

from ._connection import CLOSED, NEED_DATA, Connection, Message, check_fields, decode_control
from ._framing import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame, frame_prefix
from ._handshake import PROTOCOL_VERSION, RING_ABI, HandshakeRules, hello_fields
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
from ._progress import ProgressValidator
from ._ring_messages import INTERMEDIATE
from ._schema import BOTH, DAEMON, SCHEMAS, TERMINAL, WORKER, Spec
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
    "RING_ABI",
    "RING_HEADER_LEN",
    "SCHEMAS",
    "TERMINAL",
    "WORKER",
    "Connection",
    "Fault",
    "FrameDecoder",
    "HandshakeRules",
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
    "Spec",
    "StrikePolicy",
    "Ticket",
    "check_fields",
    "decode_control",
    "encode_frame",
    "frame_prefix",
    "hello_fields",
]
