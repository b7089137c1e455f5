"""kvcore: the unified paged KV cache of target and draft layer groups.

The services and the engine use :class:`KVCacheManager`, the :class:`KVPools` it indexes,
the specs and the plain values these hand out; nothing else here is theirs.
"""

from kvcore.aux_state import AuxState
from kvcore.manager import KVCacheManager
from kvcore.pools import KVPools, PoolWrite
from kvcore.prefix_match import PrefixMatch
from kvcore.reservation import Reservation, TransferPages
from kvcore.spec import (
    DRAFT_GROUP,
    NULL_PAGE,
    TARGET_GROUP,
    CacheConfig,
    KVLayout,
    LayerGroupSpec,
    Lifecycle,
    Owner,
)
from kvcore.stats import CacheStats, GroupStats, GroupUsage

__all__ = [
    "DRAFT_GROUP",
    "NULL_PAGE",
    "TARGET_GROUP",
    "AuxState",
    "CacheConfig",
    "CacheStats",
    "GroupStats",
    "GroupUsage",
    "KVCacheManager",
    "KVLayout",
    "KVPools",
    "LayerGroupSpec",
    "Lifecycle",
    "Owner",
    "PoolWrite",
    "PrefixMatch",
    "Reservation",
    "TransferPages",
]
