"""kvcore: the unified paged KV cache of target and draft layer groups.

The services use :class:`KVCacheManager` and the specs; nothing else here is theirs.
"""

from kvcore.manager import KVCacheManager, PrefixMatch, TransferPages
from kvcore.spec import (
    NULL_PAGE,
    CacheConfig,
    KVLayout,
    LayerGroupSpec,
    Lifecycle,
    Owner,
)
from kvcore.stats import GroupStats, GroupUsage

__all__ = [
    "NULL_PAGE",
    "CacheConfig",
    "GroupStats",
    "GroupUsage",
    "KVCacheManager",
    "KVLayout",
    "LayerGroupSpec",
    "Lifecycle",
    "Owner",
    "PrefixMatch",
    "TransferPages",
]
