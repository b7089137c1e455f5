"""Argument checks shared by the reference ops and the GPU kernels.

The values of kvcore.ops.batch check their own invariants once, when built
(``batch.py``, with ``check_basics.py``'s helpers); an op then checks only
how its query, q/k/v and pool relate to them. Only shapes, ranks, dtypes and devices are
checked: nothing here reads tensor values, so the checks never synchronize a device and
are safe inside CUDA-graph capture. Every failure is a ValueError naming the offending
argument or field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcore.ops.check_basics import check_index, fail

if TYPE_CHECKING:
    from kvcore.ops.batch import PagedBatch, RotaryWrite

POOL_RANK = 6  # [num_pages, num_layers, 2, num_kv_heads, tokens_per_page, head_dim]


def check_pool(kv_pool: torch.Tensor, layer: int | None = None) -> None:
    if kv_pool.dim() != POOL_RANK or kv_pool.shape[2] != 2:
        fail(
            "kv_pool",
            "expected [num_pages, num_layers, 2, num_kv_heads, tokens_per_page, "
            f"head_dim], got {tuple(kv_pool.shape)}",
        )
    if layer is not None and not 0 <= layer < kv_pool.shape[1]:
        fail("layer", f"must be in [0, {kv_pool.shape[1]}), got {layer}")


def check_write(
    kv_pool: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_pool(kv_pool, layer)
    heads_dim = (kv_pool.shape[3], kv_pool.shape[5])
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != heads_dim:
            fail(name, f"expected [num_tokens, {heads_dim[0]}, {heads_dim[1]}], got {tuple(t.shape)}")
    if key.shape != value.shape:
        fail("value", f"shape {tuple(value.shape)} differs from key's {tuple(key.shape)}")
    check_index(slot_mapping, "slot_mapping", 1, kv_pool.device)
    if slot_mapping.shape[0] != key.shape[0]:
        fail("slot_mapping", f"has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")


def check_write_rotated(
    kv_pool: torch.Tensor, layer: int, qkv: torch.Tensor, num_q_heads: int, write: RotaryWrite
) -> None:
    """qkv [num_tokens, num_q_heads + 2 * num_kv_heads, head_dim]; the write's cos/sin hold
    num_tokens * head_dim elements, its slot_mapping num_tokens, on the pool's device."""
    check_pool(kv_pool, layer)
    num_kv, head_dim = kv_pool.shape[3], kv_pool.shape[5]
    if qkv.dim() != 3 or tuple(qkv.shape[1:]) != (num_q_heads + 2 * num_kv, head_dim):
        fail("qkv", f"expected [num_tokens, {num_q_heads + 2 * num_kv}, {head_dim}], got {tuple(qkv.shape)}")
    if head_dim % 2:
        fail("qkv", f"head_dim {head_dim} is odd: rotate-half needs pairs")
    for name, t in (("cos", write.cos), ("sin", write.sin)):
        if t.numel() != qkv.shape[0] * head_dim:
            fail(name, f"expected [{qkv.shape[0]}, 1, {head_dim}] float32, got {tuple(t.shape)} {t.dtype}")
    slots = write.slot_mapping
    if slots.device != kv_pool.device:
        fail("slot_mapping", f"on {slots.device}, expected {kv_pool.device}")
    if slots.shape[0] != qkv.shape[0]:
        fail("slot_mapping", f"has {slots.shape[0]} entries for {qkv.shape[0]} tokens")


def check_attention(query: torch.Tensor, kv_pool: torch.Tensor, layer: int, batch: PagedBatch) -> None:
    """query [num_tokens, num_q_heads, head_dim] against the pool and the batch; a uniform
    batch has exactly ``batch.max_q_len`` tokens per sequence."""
    check_pool(kv_pool, layer)
    if query.dim() != 3:
        fail("query", f"expected [num_tokens, num_q_heads, head_dim], got {tuple(query.shape)}")
    if query.device != kv_pool.device:
        fail("query", f"on {query.device}, kv_pool on {kv_pool.device}")
    if not query.dtype.is_floating_point:
        fail("query", f"expected a float dtype, got {query.dtype}")
    num_kv_heads, head_dim = kv_pool.shape[3], kv_pool.shape[5]
    if query.shape[2] != head_dim:
        fail("query", f"head_dim {query.shape[2]} differs from the pool's {head_dim}")
    if query.shape[1] % num_kv_heads != 0:
        fail("query", f"num_q_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if batch.device != kv_pool.device:
        fail("block_table", f"on {batch.device}, expected {kv_pool.device}")
    if batch.query_start_loc is None and query.shape[0] != batch.size * batch.max_q_len:
        fail("query", f"{query.shape[0]} tokens for {batch.size} sequences of {batch.max_q_len}")


def check_uniform(batch: PagedBatch, q_len: int) -> None:
    """decode_attention (q_len 1) and verify_attention take a uniform batch of their q_len."""
    if batch.query_start_loc is not None:
        fail("query_start_loc", "decode and verify take a uniform batch, built without query starts")
    if batch.max_q_len != q_len:
        fail("max_q_len", f"is {batch.max_q_len}, the query has {q_len} tokens per sequence")


def check_verify_query(query: torch.Tensor, batch: PagedBatch) -> None:
    """verify_attention's query: [batch, q_len, num_q_heads, head_dim]."""
    if query.dim() != 4:
        fail("query", f"expected [batch, q_len, num_q_heads, head_dim], got {tuple(query.shape)}")
    check_uniform(batch, query.shape[1])


def check_page_ids(kv_pool: torch.Tensor, page_ids: torch.Tensor, field: str) -> None:
    check_index(page_ids, field, 1, kv_pool.device)


def check_unpack(
    kv_pool: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor, heads: slice | None
) -> None:
    """unpack_pages: ``packed`` is pack_pages' output for these pages and heads."""
    check_pool(kv_pool)
    check_page_ids(kv_pool, page_ids, "page_ids")
    shape = list(kv_pool.shape)
    shape[0] = page_ids.shape[0]
    if heads is not None:
        shape[3] = len(range(*heads.indices(kv_pool.shape[3])))
    if list(packed.shape) != shape:
        fail("packed", f"expected shape {tuple(shape)}, got {tuple(packed.shape)}")
    if packed.dtype != kv_pool.dtype:
        fail("packed", f"dtype {packed.dtype} differs from the pool's {kv_pool.dtype}")
    if packed.device != kv_pool.device:
        fail("packed", f"on {packed.device}, kv_pool on {kv_pool.device}")
