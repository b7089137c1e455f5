"""Paged-KV ops over a layer group's pool
``[num_pages, num_layers, 2, num_kv_heads, tokens_per_page, head_dim]``.

CUDA tensors go to the GPU kernels (kvcore.ops.gpu), others to the torch reference
(kvcore.ops.reference), which defines the semantics. What an attention op reads besides
its query and pool comes as two values (kvcore.ops.batch): the forward's
:class:`PagedBatch` (per layer group) and the layer's :class:`AttentionParams`; a
rotate-and-write takes its per-token angles and slots as one :class:`RotaryWrite`.
"""

from kvcore.ops.batch import AttentionParams, PagedBatch, RotaryWrite
from kvcore.ops.dispatch import (
    copy_pages,
    decode_attention,
    pack_pages,
    paged_attention,
    prefill_attention,
    unpack_pages,
    verify_attention,
    write_kv,
    write_rotated_kv,
)
from kvcore.ops.reference import sink_share
from kvcore.ops.slots import query_positions, slot_mapping_for, slots_at, uniform_slots

__all__ = [
    "AttentionParams",
    "PagedBatch",
    "RotaryWrite",
    "copy_pages",
    "decode_attention",
    "pack_pages",
    "paged_attention",
    "prefill_attention",
    "query_positions",
    "sink_share",
    "slot_mapping_for",
    "slots_at",
    "uniform_slots",
    "unpack_pages",
    "verify_attention",
    "write_kv",
    "write_rotated_kv",
]
