"""Sans-I/O core: framing, messages, handshake, requests and progress rules, strike/quarantine policy, leases.

Nothing here imports trio, socket, os or tinygrad; time is passed in, never read.
"""

from ._connection import CLOSED, NEED_DATA, Connection, decode_control
from ._extensions import ALL as EXTENSIONS
from ._extensions import CANCEL as EXT_CANCEL
from ._extensions import LONG as EXT_LONG
from ._extensions import MAX_TOP_LOGPROBS, V3_MAX_GEN_TOKENS, advertised
from ._extensions import SAMPLING as EXT_SAMPLING
from ._extensions import STREAM as EXT_STREAM
from ._extensions import describe as describe_extensions
from ._extensions import required as required_extensions
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
    "EXTENSIONS",
    "EXT_CANCEL",
    "EXT_LONG",
    "EXT_SAMPLING",
    "EXT_STREAM",
    "GENERATION_TRANSITIONS",
    "INTERMEDIATE",
    "LANE_TRANSITIONS",
    "MAX_TOP_LOGPROBS",
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
    "V3_MAX_GEN_TOKENS",
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
    "advertised",
    "check_fields",
    "decode_control",
    "describe_extensions",
    "encode_frame",
    "frame_prefix",
    "hello_fields",
    "is_request",
    "required_extensions",
]
