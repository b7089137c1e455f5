"""64-bit tags of KV transfer messages.

A transport matches tags per transport (UCX: per worker), not per endpoint, so a tag alone
must tell every message a worker can receive apart. A tag is laid out as

    bits 63..24  request key: 40 bits of BLAKE2b(request id), stable across processes
    bits 23..16  group index: the layer group's index in the cache config (0..255)
    bits 15..0   chunk: the message's index within that group (0..65535)

``request_tag`` is the per-request base (low 24 bits zero); it is what a
reservation carries as ``transfer_tag``. Group indices past the cache's groups are
free for per-request side messages: the top three are reserved below, and page messages
of sender rank s use ``group index + number of groups * s``, which must stay under them.
"""

from __future__ import annotations

import hashlib

GROUP_BITS = 8
CHUNK_BITS = 16
REQUEST_BITS = 64 - GROUP_BITS - CHUNK_BITS
MAX_GROUPS = 1 << GROUP_BITS
MAX_CHUNKS = 1 << CHUNK_BITS
_LOW_BITS = GROUP_BITS + CHUNK_BITS

AUX_GROUP = MAX_GROUPS - 1  # group index of a request's aux-state message
ACK_GROUP = MAX_GROUPS - 2  # group index of the receiver's acknowledgement
PING_GROUP = MAX_GROUPS - 3  # group index of the pairing side channel (nonce, not request)


def request_tag(request_id: str) -> int:
    """Base tag of a request: its 40-bit key in bits 63..24, zeros below.

    Uses BLAKE2b, not ``hash()``, whose value differs between processes.
    """
    if not request_id:
        raise ValueError("request_id: must be non-empty")
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    key = int.from_bytes(digest, "little") >> (64 - REQUEST_BITS)
    return key << _LOW_BITS


def check_tag(tag: int) -> int:
    """``tag`` itself, once it is a 64-bit unsigned integer; ValueError naming ``tag``."""
    if not isinstance(tag, int) or not 0 <= tag < 1 << 64:
        raise ValueError(f"tag: must be a 64-bit unsigned integer, got {tag!r}")
    return tag


def is_base_tag(tag: int) -> bool:
    """Whether ``tag`` can be a transfer's base tag: 64 bits, its low 24 (group and chunk) zero."""
    return 0 <= tag < 1 << 64 and not tag & ((1 << _LOW_BITS) - 1)


def message_tag(base_tag: int, group_index: int, chunk: int) -> int:
    """Tag of one message: ``base_tag`` (from :func:`request_tag`) plus group and chunk."""
    if not is_base_tag(base_tag):
        raise ValueError(
            f"base_tag: must be a 64-bit tag with its low {_LOW_BITS} bits zero, got {base_tag:#x}"
        )
    if not 0 <= group_index < MAX_GROUPS:
        raise ValueError(f"group_index: must be in [0, {MAX_GROUPS}), got {group_index}")
    if not 0 <= chunk < MAX_CHUNKS:
        raise ValueError(f"chunk: must be in [0, {MAX_CHUNKS}), got {chunk}")
    return base_tag | group_index << CHUNK_BITS | chunk


def make_tag(request_id: str, group_index: int, chunk: int) -> int:
    """Tag of chunk ``chunk`` of group ``group_index`` of request ``request_id``."""
    return message_tag(request_tag(request_id), group_index, chunk)


def split_tag(tag: int) -> tuple[int, int, int]:
    """Inverse of :func:`message_tag`: (base_tag, group_index, chunk)."""
    if not 0 <= tag < 1 << 64:
        raise ValueError(f"tag: must be a 64-bit unsigned integer, got {tag}")
    base = tag & ~((1 << _LOW_BITS) - 1)
    return base, (tag >> CHUNK_BITS) & (MAX_GROUPS - 1), tag & (MAX_CHUNKS - 1)
