"""Whole-page moves: pack for transfer, unpack on arrival, copy-on-write.

These are torch index ops on any device; they move bytes unchanged, so every dtype
(fp8 included) round-trips bit-exactly. ``packed`` is always contiguous:
``[n, num_layers, 2, num_heads, tokens_per_page, head_dim]``, page i of it being
``page_ids[i]`` of the pool.
"""

from __future__ import annotations

import torch

from kvcore.ops.checks import check_page_ids, check_pool, check_unpack, fail

BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Same-size integer view: index ops on it move bytes for every float dtype (fp8 too)."""
    return t.view(BITS_DTYPES[t.element_size()])


def _head_view(kv_pool: torch.Tensor, heads: slice | None) -> torch.Tensor:
    """The pool's bits restricted to a kv-head range (a view: writes land in the pool)."""
    bits = as_bits(kv_pool)
    return bits if heads is None else bits[:, :, :, heads]


def pack_pages(kv_pool: torch.Tensor, page_ids: torch.Tensor, heads: slice | None = None) -> torch.Tensor:
    """Gather pages (optionally only kv heads ``heads``) into one contiguous tensor."""
    check_pool(kv_pool)
    check_page_ids(kv_pool, page_ids, "page_ids")
    packed = _head_view(kv_pool, heads).index_select(0, page_ids.long())
    return packed.view(kv_pool.dtype)


def unpack_pages(
    kv_pool: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor, heads: slice | None = None
) -> None:
    """Scatter ``packed`` (from :func:`pack_pages`) into pages ``page_ids`` of the pool."""
    check_unpack(kv_pool, page_ids, packed, heads)
    _head_view(kv_pool, heads).index_copy_(0, page_ids.long(), as_bits(packed))


def copy_pages(kv_pool: torch.Tensor, src_page_ids: torch.Tensor, dst_page_ids: torch.Tensor) -> None:
    """Copy whole pages src[i] -> dst[i] (all layers, K and V). Sources are read before
    any destination is written, so the two lists may overlap."""
    check_pool(kv_pool)
    check_page_ids(kv_pool, src_page_ids, "src_page_ids")
    check_page_ids(kv_pool, dst_page_ids, "dst_page_ids")
    if src_page_ids.shape != dst_page_ids.shape:
        fail("dst_page_ids", f"has {dst_page_ids.shape[0]} ids for {src_page_ids.shape[0]} sources")
    bits = as_bits(kv_pool)
    bits.index_copy_(0, dst_page_ids.long(), bits.index_select(0, src_page_ids.long()))
