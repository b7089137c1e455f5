"""Argument checks shared by the reference ops and the GPU kernels.

Only shapes, ranks and dtypes are checked: nothing here reads tensor values, so the
checks never synchronize a device and are safe inside CUDA-graph capture.
Every failure is a ValueError naming the offending argument.
"""

from __future__ import annotations

import torch

POOL_RANK = 6  # [num_pages, num_layers, 2, num_kv_heads, tokens_per_page, head_dim]
INDEX_DTYPES = (torch.int32, torch.int64)


def fail(field: str, msg: str) -> None:
    raise ValueError(f"{field}: {msg}")


def check_pool(kv_pool: torch.Tensor, layer: int | None = None) -> None:
    if kv_pool.dim() != POOL_RANK or kv_pool.shape[2] != 2:
        fail(
            "kv_pool",
            "expected [num_pages, num_layers, 2, num_kv_heads, tokens_per_page, "
            f"head_dim], got {tuple(kv_pool.shape)}",
        )
    if layer is not None and not 0 <= layer < kv_pool.shape[1]:
        fail("layer", f"must be in [0, {kv_pool.shape[1]}), got {layer}")


def check_index(t: torch.Tensor, field: str, rank: int, device: torch.device) -> None:
    if t.dim() != rank:
        fail(field, f"expected rank {rank}, got shape {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        fail(field, f"expected int32 or int64, got {t.dtype}")
    if t.device != device:
        fail(field, f"on {t.device}, expected {device}")


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
    kv_pool: torch.Tensor,
    layer: int,
    qkv: torch.Tensor,
    num_q_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """qkv [num_tokens, num_q_heads + 2 * num_kv_heads, head_dim]; cos/sin [num_tokens, 1,
    head_dim] float32."""
    check_pool(kv_pool, layer)
    num_kv, head_dim = kv_pool.shape[3], kv_pool.shape[5]
    if qkv.dim() != 3 or tuple(qkv.shape[1:]) != (num_q_heads + 2 * num_kv, head_dim):
        fail("qkv", f"expected [num_tokens, {num_q_heads + 2 * num_kv}, {head_dim}], got {tuple(qkv.shape)}")
    if head_dim % 2:
        fail("qkv", f"head_dim {head_dim} is odd: rotate-half needs pairs")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.numel() != qkv.shape[0] * head_dim:
            fail(name, f"expected [{qkv.shape[0]}, 1, {head_dim}] float32, got {tuple(t.shape)} {t.dtype}")
    check_index(slot_mapping, "slot_mapping", 1, kv_pool.device)
    if slot_mapping.shape[0] != qkv.shape[0]:
        fail("slot_mapping", f"has {slot_mapping.shape[0]} entries for {qkv.shape[0]} tokens")


def check_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    window: int,
    key_start: int = 0,
) -> None:
    """query: [num_tokens, num_q_heads, head_dim]; query_start_loc None: a uniform batch
    (decode, verify), whose caller checks the token count."""
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
    check_index(block_table, "block_table", 2, kv_pool.device)
    if query_start_loc is not None:
        check_index(query_start_loc, "query_start_loc", 1, kv_pool.device)
    check_index(seq_lens, "seq_lens", 1, kv_pool.device)
    batch = seq_lens.shape[0]
    if block_table.shape[0] != batch:
        fail("block_table", f"has {block_table.shape[0]} rows for batch {batch}")
    if query_start_loc is not None and query_start_loc.shape[0] != batch + 1:
        fail("query_start_loc", f"has {query_start_loc.shape[0]} entries, expected batch + 1 = {batch + 1}")
    if window < 0:
        fail("window", f"must be >= 0, got {window}")
    if key_start < 0:
        fail("key_start", f"must be >= 0, got {key_start}")


def check_page_ids(kv_pool: torch.Tensor, page_ids: torch.Tensor, field: str) -> None:
    check_index(page_ids, field, 1, kv_pool.device)


def check_packed(
    kv_pool: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor, heads: slice | None
) -> None:
    shape = list(kv_pool.shape)
    shape[0] = page_ids.shape[0]
    if heads is not None:
        shape[3] = len(range(*heads.indices(kv_pool.shape[3])))
    if list(packed.shape) != shape:
        fail("packed", f"expected shape {tuple(shape)}, got {tuple(packed.shape)}")
    if packed.dtype != kv_pool.dtype:
        fail("packed", f"dtype {packed.dtype} differs from the pool's {kv_pool.dtype}")
