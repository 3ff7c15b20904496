"""Native ring helper: MO01 header codec, ring header ABI v2, ingress drain and egress write."""

from cython_ring._mo01 import (
    FLAG_BEGIN_SEQUENCE,
    FLAG_END_OF_SEQUENCE,
    HEADER_LEN,
    MAGIC,
    VERSION,
    ObjectHeader,
    ObjectSpec,
    decode_header,
    encode_header,
    validate,
)
from cython_ring._ring import (
    RING_HEADER_LEN,
    RING_MAGIC,
    RING_VERSION,
    STATE_ACTIVE,
    STATE_CLOSED,
    STATE_FAULTED,
    WAKE_READABLE,
    WAKE_WRITABLE,
    Ring,
)
from cython_ring._stream import EgressState, IngressState, drain_ingress, write_egress

__all__ = [
    "FLAG_BEGIN_SEQUENCE",
    "FLAG_END_OF_SEQUENCE",
    "HEADER_LEN",
    "MAGIC",
    "RING_HEADER_LEN",
    "RING_MAGIC",
    "RING_VERSION",
    "STATE_ACTIVE",
    "STATE_CLOSED",
    "STATE_FAULTED",
    "VERSION",
    "WAKE_READABLE",
    "WAKE_WRITABLE",
    "EgressState",
    "IngressState",
    "ObjectHeader",
    "ObjectSpec",
    "Ring",
    "decode_header",
    "drain_ingress",
    "encode_header",
    "validate",
    "write_egress",
]
