"""Public paged-KV ops: GPU kernels for CUDA tensors (when Triton is present), the torch
reference otherwise. Both paths compute the same function; see kvcore.ops.reference.
Decode and verify are paged attention over a uniform batch, on whichever path runs."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from kvcore.ops import pages, reference
from kvcore.ops.batch import AttentionParams, PagedBatch, RotaryWrite
from kvcore.ops.checks import check_uniform, check_verify_query


@functools.cache
def _gpu_kernels() -> ModuleType | None:
    try:
        from kvcore.ops import gpu  # noqa: PLC0415 (Triton is optional: CPU-only installs run the reference)
    except ImportError:
        return None
    return gpu


def _on_gpu(t: torch.Tensor) -> ModuleType | None:
    return _gpu_kernels() if t.is_cuda else None


def write_kv(
    kv_pool: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at slots (page * P + offset);
    slot -1 is skipped. fp8 pools store a saturating cast."""
    impl = _on_gpu(kv_pool) or reference
    impl.write_kv(kv_pool, layer, key, value, slot_mapping)


def write_rotated_kv(
    kv_pool: torch.Tensor, layer: int, qkv: torch.Tensor, num_q_heads: int, write: RotaryWrite
) -> torch.Tensor:
    """Rotate a merged q/k/v's q and k (rotate-half RoPE) and store k and v at the write's
    slots, in one pass; returns the rotated q. See reference.write_rotated_kv."""
    impl = _on_gpu(kv_pool) or reference
    return impl.write_rotated_kv(kv_pool, layer, qkv, num_q_heads, write)


def paged_attention(
    query: torch.Tensor, kv_pool: torch.Tensor, layer: int, batch: PagedBatch, params: AttentionParams
) -> torch.Tensor:
    """Varlen causal attention over paged K/V; see reference.paged_attention."""
    impl = _on_gpu(query) or reference
    return impl.paged_attention(query, kv_pool, layer, batch, params)


def decode_attention(
    query: torch.Tensor, kv_pool: torch.Tensor, layer: int, batch: PagedBatch, params: AttentionParams
) -> torch.Tensor:
    """query [batch, num_q_heads, head_dim], one token per sequence (a uniform batch)."""
    check_uniform(batch, 1)
    return paged_attention(query, kv_pool, layer, batch, params)


def verify_attention(
    query: torch.Tensor, kv_pool: torch.Tensor, layer: int, batch: PagedBatch, params: AttentionParams
) -> torch.Tensor:
    """query [batch, q_len, num_q_heads, head_dim], q_len = K + 1 tokens per sequence (a
    uniform batch)."""
    check_verify_query(query, batch)
    return paged_attention(query.flatten(0, 1), kv_pool, layer, batch, params).view(query.shape)


prefill_attention = paged_attention
"""Prompt chunks over a cached prefix (seq_lens > q_len): paged_attention."""


def pack_pages(kv_pool: torch.Tensor, page_ids: torch.Tensor, heads: slice | None = None) -> torch.Tensor:
    """Contiguous copy of pages ``page_ids`` (optionally only kv heads ``heads``):
    [n, num_layers, 2, num_heads, P, head_dim]. The transfer primitive."""
    return (_on_gpu(kv_pool) or pages).pack_pages(kv_pool, page_ids, heads)


def unpack_pages(
    kv_pool: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor, heads: slice | None = None
) -> None:
    """Write ``packed`` (from pack_pages) into pages ``page_ids``; bit-exact."""
    (_on_gpu(kv_pool) or pages).unpack_pages(kv_pool, page_ids, packed, heads)


def copy_pages(kv_pool: torch.Tensor, src_page_ids: torch.Tensor, dst_page_ids: torch.Tensor) -> None:
    """Copy whole pages src[i] -> dst[i]; all sources are read before any write."""
    (_on_gpu(kv_pool) or pages).copy_pages(kv_pool, src_page_ids, dst_page_ids)
