"""Pure-torch reference of the paged-KV ops: the specification the GPU kernels match.

Pool layout (see kvcore.spec): ``kv_pool [num_pages, num_layers, 2, num_kv_heads, P, head_dim]``.
The token at position t of a sequence lives in page ``block_table[b, t // P]``, slot ``t % P``.

Attention is computed in float32 over all sequences of a batch at once: each sequence's
needed pages are gathered into one padded tensor, then a single masked attention runs.
Pages holding no visible key (wholly out of the window, NULL, past the extent) are never
gathered; NULL entries inside the gathered range are replaced by zeros, never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcore.ops.batch import AttentionParams, PagedBatch, RotaryWrite
from kvcore.ops.checks import (
    check_attention,
    check_uniform,
    check_verify_query,
    check_write,
    check_write_rotated,
    fail,
)
from kvcore.ops.slots import uniform_query_start_loc
from kvcore.spec import NULL_PAGE

FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)


def to_pool_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast to the pool dtype; fp8 saturates at the format's max instead of producing NaN."""
    if dtype in FP8_DTYPES:
        fp8_max = torch.finfo(dtype).max
        return x.float().clamp(-fp8_max, fp8_max).to(dtype)
    return x.to(dtype)


def write_kv(
    kv_pool: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value ``[num_tokens, num_kv_heads, head_dim]`` of one layer at slots
    ``page_id * P + offset``; slots equal to -1 are skipped."""
    check_write(kv_pool, layer, key, value, slot_mapping)
    tokens_per_page = kv_pool.shape[4]
    keep = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[keep].long()
    pages, offsets = slots // tokens_per_page, slots % tokens_per_page
    kv_pool[pages, layer, 0, :, offsets] = to_pool_dtype(key[keep], kv_pool.dtype)
    kv_pool[pages, layer, 1, :, offsets] = to_pool_dtype(value[keep], kv_pool.dtype)


def write_rotated_kv(
    kv_pool: torch.Tensor, layer: int, qkv: torch.Tensor, num_q_heads: int, write: RotaryWrite
) -> torch.Tensor:
    """A merged, unrotated q/k/v ``[num_tokens, num_q_heads + 2 * num_kv_heads, head_dim]``
    (q heads, then k, then v): q and k rotated by rotate-half RoPE (pairs i, i + head_dim / 2;
    ``write.cos``/``write.sin`` ``[num_tokens, 1, head_dim]`` float32, computed in float32
    and rounded to qkv's dtype), k and v stored as :func:`write_kv` stores them, at
    ``write.slot_mapping``. Returns the rotated q ``[num_tokens, num_q_heads, head_dim]``."""
    check_write_rotated(kv_pool, layer, qkv, num_q_heads, write)
    num_kv = (qkv.shape[1] - num_q_heads) // 2
    qk = qkv[:, : num_q_heads + num_kv].float()
    half = qk.shape[-1] // 2
    rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
    qk = (qk * write.cos + rotated * write.sin).to(qkv.dtype)
    write_kv(kv_pool, layer, qk[:, num_q_heads:], qkv[:, num_q_heads + num_kv :], write.slot_mapping)
    return qk[:, :num_q_heads]


def paged_attention(
    query: torch.Tensor, kv_pool: torch.Tensor, layer: int, batch: PagedBatch, params: AttentionParams
) -> torch.Tensor:
    """Causal (optionally sliding-window) attention of varlen queries over paged K/V.

    query: [num_tokens, num_q_heads, head_dim], the batch's queries in sequence order
    (``batch.query_start_loc``; a uniform batch: ``batch.max_q_len`` per sequence). Query i
    of sequence b sits at position ``seq_lens[b] - q_len_b + i`` and sees keys j with
    ``pos - window < j <= pos`` (no lower bound when window == 0) and ``j >= key_start``
    (positions below it hold no visible key: an EAGLE-3 drafter's unused first slot); see
    :class:`PagedBatch`. A row that sees no key outputs zeros.
    Returns [num_tokens, num_q_heads, head_dim] in the query's dtype.
    """
    check_attention(query, kv_pool, layer, batch)
    num_tokens, num_q_heads, head_dim = query.shape
    if num_tokens == 0 or batch.size == 0 or batch.block_table.shape[1] == 0:
        return query.new_zeros(query.shape)
    starts = batch.query_start_loc
    if starts is None:
        starts = uniform_query_start_loc(batch.seq_lens, batch.max_q_len)
    q_lens = (starts[1:] - starts[:-1]).long()  # [batch]
    seq_of_token = torch.repeat_interleave(torch.arange(batch.size, device=query.device), q_lens)
    index_in_seq = torch.arange(num_tokens, device=query.device) - starts[seq_of_token]
    max_q = int(q_lens.max())
    if max_q > batch.max_q_len:
        fail("max_q_len", f"is {batch.max_q_len}, a sequence of the batch has {max_q} queries")

    q = query.new_zeros((batch.size, max_q, num_q_heads, head_dim), dtype=torch.float32)
    q[seq_of_token, index_in_seq] = query.float()
    keys, values, key_pos, key_ok = _gather_context(kv_pool, layer, batch, q_lens)
    q_pos = (batch.seq_lens.long() - q_lens)[:, None] + torch.arange(max_q, device=query.device)
    if batch.key_start > 0:  # zero the hidden keys: 0 * NaN would leak through the matmuls
        key_ok &= key_pos >= batch.key_start
        keys = keys.masked_fill(~key_ok[:, None, :, None], 0.0)
        values = values.masked_fill(~key_ok[:, None, :, None], 0.0)
    mask = _attention_mask(q_pos, q_lens, key_pos, key_ok, batch.window)  # [batch, max_q, num_keys]
    out = _masked_attention(q, keys, values, mask, params.scale)  # [batch, max_q, num_q_heads, hd]
    if params.sinks is not None:
        out = out * sink_share(q, keys, mask, params)[..., None]
    return out[seq_of_token, index_in_seq].to(query.dtype)


def sink_share(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, params: AttentionParams
) -> torch.Tensor:
    """What the keys keep of a row's softmax beside its head's sink: sum / (sum + exp(sink))
    = sigmoid(logsumexp(scores) - sink). q [batch, max_q, num_q_heads, hd]; keys [batch,
    num_kv_heads, num_keys, hd]; mask [batch, max_q, num_keys] -> [batch, max_q,
    num_q_heads] float32 (0 for a row that sees no key)."""
    group = q.shape[2] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # [batch, num_q_heads, num_keys, hd]
    scores = torch.einsum("bqhd,bhkd->bqhk", q.float(), k) * params.scale
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [batch, max_q, num_q_heads]; -inf: no key
    return torch.sigmoid(lse - params.sinks.float())


def _gather_context(kv_pool: torch.Tensor, layer: int, batch: PagedBatch, q_lens: torch.Tensor):
    """Gather, per sequence, the pages from the first one any query can see to the last
    one of the context. Returns keys/values [batch, num_kv_heads, num_keys, head_dim]
    (float32, zeros where no page is held), key positions [batch, num_keys] and
    key_ok [batch, num_keys] (held and inside the context)."""
    block_table, window = batch.block_table, batch.window
    tokens_per_page, max_pages = kv_pool.shape[4], block_table.shape[1]
    seq_lens = batch.seq_lens.long()
    first_pos = torch.zeros_like(seq_lens)
    if window > 0:
        first_pos = (seq_lens - q_lens - window + 1).clamp_min(0)
    first_page = first_pos // tokens_per_page  # [batch]
    end_page = (seq_lens + tokens_per_page - 1) // tokens_per_page  # [batch], exclusive
    num_pages = int((end_page - first_page).clamp_min(0).max())
    page_index = first_page[:, None] + torch.arange(num_pages, device=kv_pool.device)
    in_range = (page_index < end_page[:, None]) & (page_index < max_pages)
    page_ids = block_table.gather(1, page_index.clamp(max=max_pages - 1)).long()
    held = in_range & (page_ids != NULL_PAGE)  # [batch, num_pages]
    pages = kv_pool[torch.where(held, page_ids, 0), layer].float()  # [b, n, 2, kvh, P, hd]
    pages = torch.where(held[:, :, None, None, None, None], pages, 0.0)
    size, _, _, num_kv_heads, _, head_dim = pages.shape
    kv = pages.permute(2, 0, 3, 1, 4, 5).reshape(2, size, num_kv_heads, -1, head_dim)
    offsets = torch.arange(num_pages * tokens_per_page, device=kv_pool.device)
    key_pos = first_page[:, None] * tokens_per_page + offsets  # [batch, num_keys]
    key_ok = held.repeat_interleave(tokens_per_page, dim=1) & (key_pos < seq_lens[:, None])
    return kv[0], kv[1], key_pos, key_ok


def _attention_mask(
    q_pos: torch.Tensor, q_lens: torch.Tensor, key_pos: torch.Tensor, key_ok: torch.Tensor, window: int
) -> torch.Tensor:
    """[batch, max_q, num_keys]: query row i of b may attend key column j."""
    max_q = q_pos.shape[1]
    q_ok = torch.arange(max_q, device=q_pos.device)[None, :] < q_lens[:, None]
    mask = key_ok[:, None, :] & q_ok[:, :, None]
    mask &= key_pos[:, None, :] <= q_pos[:, :, None]
    if window > 0:
        mask &= key_pos[:, None, :] > q_pos[:, :, None] - window
    return mask


def _masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [batch, max_q, num_q_heads, hd]; keys/values [batch, num_kv_heads, num_keys, hd];
    mask [batch, max_q, num_keys]. Query head h reads kv head h // group; a row that sees
    no key outputs zeros. torch's fused attention: the same function as the softmax
    written out, in a few passes over the scores instead of six."""
    batch, max_q, num_q_heads, head_dim = q.shape
    if keys.shape[2] == 0:
        return q.new_zeros(q.shape)
    seen = mask.any(dim=-1)  # [batch, max_q]
    attend = mask | ~seen[:, :, None]  # a row that sees nothing attends all, then is zeroed
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [batch, num_q_heads, max_q, hd]
        keys,
        values,
        attn_mask=attend[:, None],
        scale=scale,
        enable_gqa=num_q_heads != keys.shape[1],
    )  # [batch, num_q_heads, max_q, hd]
    return torch.where(seen[:, :, None, None], out.transpose(1, 2), 0.0)


def decode_attention(
    query: torch.Tensor, kv_pool: torch.Tensor, layer: int, batch: PagedBatch, params: AttentionParams
) -> torch.Tensor:
    """One query token per sequence of a uniform batch (max_q_len 1).
    query: [batch, num_q_heads, head_dim] -> same shape."""
    check_uniform(batch, 1)
    return paged_attention(query, kv_pool, layer, batch, params)


def verify_attention(
    query: torch.Tensor, kv_pool: torch.Tensor, layer: int, batch: PagedBatch, params: AttentionParams
) -> torch.Tensor:
    """q_len (= K + 1) query tokens per sequence of a uniform batch (max_q_len q_len), causal
    inside the block. query: [batch, q_len, num_q_heads, head_dim] -> same shape."""
    check_verify_query(query, batch)
    out = paged_attention(query.flatten(0, 1), kv_pool, layer, batch, params)
    return out.view(query.shape)


prefill_attention = paged_attention
