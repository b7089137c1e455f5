"""Moving KV pages between worker processes: the UCX transport and its message tags."""

from kvcore.transfer.tags import make_tag, message_tag, request_tag, split_tag
from kvcore.transfer.ucx import (
    LOOPBACK_ENV,
    TransferError,
    TransferTimeout,
    TransportClosed,
    UcxEndpointInfo,
    UcxPath,
    UcxTransport,
)

__all__ = [
    "LOOPBACK_ENV",
    "TransferError",
    "TransferTimeout",
    "TransportClosed",
    "UcxEndpointInfo",
    "UcxPath",
    "UcxTransport",
    "make_tag",
    "message_tag",
    "request_tag",
    "split_tag",
]
