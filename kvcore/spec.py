"""Layer-group and cache specifications: plain, validated data.

A *layer group* is a set of layers that share KV geometry. Each group owns one
page pool in its own dtype; page ``p`` of a group holds ``tokens_per_page``
tokens of *every* layer of that group, so one page is one contiguous slab:

    pool: [num_pages, num_layers, 2 (K/V), num_kv_heads, tokens_per_page, head_dim]

All groups of one cache share ``tokens_per_page``; page ids are per group.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

NULL_PAGE = -1
"""Block-table entry of a page that is not held (released out of the window, or past the extent)."""
HOST_WRITE_POLICIES = ("evict", "through")
"""When a cached page is copied to the host tier: as it leaves the device ("evict", write-back),
or as it enters the prefix cache ("through", write-through: evictions then copy nothing)."""


class Owner(enum.Enum):
    TARGET = "target"
    DRAFT = "draft"


TARGET_GROUP = "target"
"""Name of the target model's (first) layer group: the engine's first, REQUIRED group. A
target whose layers mix windows has one more REQUIRED group per other window."""
DRAFT_GROUP = "draft"
"""Name of the drafter's layer group."""


class Lifecycle(enum.Enum):
    """How a group takes part in reuse. REQUIRED groups decide the prefix match;
    OPTIONAL groups are reused only where they are complete, else recomputed."""

    REQUIRED = "required"
    OPTIONAL = "optional"


class KVLayout(enum.Enum):
    """UNIFIED: the draft group lives in the same manager as the target's, shares its
    reuse decisions and is transferred with it. SEPARATE: the draft group has its own
    budget, is never cached nor transferred (the baseline)."""

    UNIFIED = "unified"
    SEPARATE = "separate"


_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPES["float8_e4m3fn"] = torch.float8_e4m3fn

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
}


def dtype_from_name(name: str) -> torch.dtype:
    """Canonical or alias dtype name -> torch dtype; ValueError naming the dtype otherwise."""
    key = _DTYPE_ALIASES.get(name, name)
    if key not in _DTYPES:
        raise ValueError(f"dtype: unknown KV dtype {name!r}; known: {sorted(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype: unsupported KV dtype {dtype}")


def _require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field_name}: {msg}")


@dataclass(frozen=True, slots=True)
class LayerGroupSpec:
    """Geometry of one layer group. ``window`` is in tokens (0 = full attention): a query
    at position q attends keys at positions in (q - window, q]."""

    name: str
    owner: Owner
    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    dtype: str = "bfloat16"
    window: int = 0
    lifecycle: Lifecycle = Lifecycle.REQUIRED
    layer_ids: tuple[int, ...] = ()  # global layer ids; defaults to range(num_layers)

    def __post_init__(self) -> None:
        _require(bool(self.name), "name", "must be non-empty")
        _require(isinstance(self.owner, Owner), "owner", f"must be an Owner, got {self.owner!r}")
        _require(
            isinstance(self.lifecycle, Lifecycle), "lifecycle", f"must be a Lifecycle, got {self.lifecycle!r}"
        )
        _require(self.num_layers > 0, "num_layers", f"must be > 0, got {self.num_layers}")
        _require(self.num_kv_heads > 0, "num_kv_heads", f"must be > 0, got {self.num_kv_heads}")
        _require(self.head_dim > 0, "head_dim", f"must be > 0, got {self.head_dim}")
        _require(self.window >= 0, "window", f"must be >= 0, got {self.window}")
        dtype_from_name(self.dtype)
        if not self.layer_ids:
            object.__setattr__(self, "layer_ids", tuple(range(self.num_layers)))
        _require(
            len(self.layer_ids) == self.num_layers,
            "layer_ids",
            f"has {len(self.layer_ids)} ids for {self.num_layers} layers",
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def element_bytes(self) -> int:
        return self.torch_dtype.itemsize

    def page_shape(self, tokens_per_page: int) -> tuple[int, ...]:
        """Shape of one page: [num_layers, 2, num_kv_heads, tokens_per_page, head_dim]."""
        return (self.num_layers, 2, self.num_kv_heads, tokens_per_page, self.head_dim)

    def page_bytes(self, tokens_per_page: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * tokens_per_page * self.head_dim * self.element_bytes


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Everything the cache manager needs. Memory is given either as page counts per group
    (``num_pages``) or as a byte budget split by :func:`kvcore.capacity.split_capacity`.

    ``num_spec_tokens`` is K; ``draft_block_width`` the positions a drafter writes past
    the context in one step (1 for a chain drafter). Headroom per request, in tokens, is
    ``max(K + 1, draft_block_width)``.
    """

    groups: tuple[LayerGroupSpec, ...]
    tokens_per_page: int = 16
    num_pages: tuple[int, ...] = ()  # one per group; empty = derive from memory_bytes
    memory_bytes: int = 0
    max_num_seqs: int = 64
    max_prefill_chunk: int = 2048  # tokens
    num_spec_tokens: int = 0
    draft_block_width: int = 1
    layout: KVLayout = KVLayout.UNIFIED
    enable_prefix_cache: bool = True
    host_num_pages: int = 0  # host-tier pages per cached group; 0 = no host tier
    host_write_policy: str = "evict"  # host copy made when a page leaves the device, or "through"
    host_recall_min_pages: int = 1  # a host hit shorter than this is recomputed, not recalled
    group_names: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        _require(len(self.groups) > 0, "groups", "at least one layer group is required")
        _require(self.tokens_per_page > 0, "tokens_per_page", f"must be > 0, got {self.tokens_per_page}")
        _require(self.num_spec_tokens >= 0, "num_spec_tokens", f"must be >= 0, got {self.num_spec_tokens}")
        _require(
            self.draft_block_width > 0, "draft_block_width", f"must be > 0, got {self.draft_block_width}"
        )
        _require(self.max_num_seqs > 0, "max_num_seqs", f"must be > 0, got {self.max_num_seqs}")
        _require(
            self.max_prefill_chunk > 0, "max_prefill_chunk", f"must be > 0, got {self.max_prefill_chunk}"
        )
        _require(isinstance(self.layout, KVLayout), "layout", f"must be a KVLayout, got {self.layout!r}")
        names = tuple(g.name for g in self.groups)
        _require(len(set(names)) == len(names), "groups", f"duplicate group names {names}")
        _require(
            self.groups[0].owner == Owner.TARGET and self.groups[0].lifecycle == Lifecycle.REQUIRED,
            "groups",
            "the first group must be the target's REQUIRED group",
        )
        if self.num_pages:
            _require(
                len(self.num_pages) == len(self.groups),
                "num_pages",
                f"has {len(self.num_pages)} entries for {len(self.groups)} groups",
            )
            for n in self.num_pages:
                _require(n > 0, "num_pages", f"every entry must be > 0, got {self.num_pages}")
        else:
            _require(self.memory_bytes > 0, "memory_bytes", "must be > 0 when num_pages is not given")
        self._check_host_tier()
        object.__setattr__(self, "group_names", names)

    def _check_host_tier(self) -> None:
        _require(self.host_num_pages >= 0, "host_num_pages", f"must be >= 0, got {self.host_num_pages}")
        _require(
            self.host_write_policy in HOST_WRITE_POLICIES,
            "host_write_policy",
            f"must be one of {HOST_WRITE_POLICIES}, got {self.host_write_policy!r}",
        )
        _require(
            self.host_recall_min_pages >= 1,
            "host_recall_min_pages",
            f"must be >= 1, got {self.host_recall_min_pages}",
        )

    @property
    def headroom_tokens(self) -> int:
        return max(self.num_spec_tokens + 1, self.draft_block_width)

    def group(self, name: str) -> LayerGroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"group {name!r} not in {self.group_names}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
