"""Self-attention with a pluggable KV context.

The model code is the same for serving and training; only the context differs:
- :class:`PagedContext` writes K/V into a layer group's page pool and attends through
  kvcore's paged attention (the serving path);
- :class:`DenseContext` attends over a dense ``[batch, seq_len]`` block with causal
  SDPA (training and plain reference runs).
Both apply the same rule: a query at position q sees keys in (q - window, q]
(window 0 = no lower bound).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvcore.ops import (
    AttentionParams,
    PagedBatch,
    RotaryWrite,
    paged_attention,
    sink_share,
    write_kv,
    write_rotated_kv,
)
from services.engine import kernels
from services.engine.models.fp8 import (
    DRAFT,
    Fp8Linear,
    Fp8Mode,
    Fp8Weight,
    fp8_linear_of,
    fp8_merged,
    linear,
    merge_fp8,
)
from services.engine.models.layers import RMSNorm, merge_linears
from services.engine.parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    head_rows,
    kv_heads,
    split,
)


class KVContext(Protocol):
    """Attends q to the keys before it; a paged context (:class:`WritesPages`) first
    writes k and v, and also takes the merged q/k/v before RoPE (``attend_packed``)."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams
    ) -> torch.Tensor: ...


class WritesPages:
    """The writing half of a paged context: K/V go to ``self.kv_pool`` at
    ``self.slot_mapping`` (slot -1: not written), then ``self._attend_written(layer, q,
    params)`` attends over the pages. Tensors are flat over tokens."""

    __slots__ = ()
    kv_pool: torch.Tensor
    slot_mapping: torch.Tensor

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams
    ) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim], k/v [num_tokens, num_kv_heads, head_dim]."""
        write_kv(self.kv_pool, layer, k, v, self.slot_mapping)
        return self._attend_written(layer, q, params)

    def attend_packed(
        self,
        layer: int,
        qkv: torch.Tensor,
        num_q_heads: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        params: AttentionParams,
    ) -> torch.Tensor:
        """qkv [num_tokens, num_q_heads + 2 * num_kv_heads, head_dim], before RoPE; rope:
        cos, sin [num_tokens, 1, head_dim] float32. q and k are rotated as k is written."""
        write = RotaryWrite(*rope, self.slot_mapping)
        q = write_rotated_kv(self.kv_pool, layer, qkv, num_q_heads, write)
        return self._attend_written(layer, q, params)

    def _attend_written(self, layer: int, q: torch.Tensor, params: AttentionParams) -> torch.Tensor:
        raise NotImplementedError


@dataclass(slots=True)
class PagedContext(WritesPages):
    """One forward's view of one layer group: its pool, its batch (block table, query
    starts, lengths, window: see kvcore's PagedBatch) and where its tokens' K/V go. The
    K/V of the batch's queries are written before attending."""

    kv_pool: torch.Tensor  # [num_pages, num_layers, 2, num_kv_heads, tokens_per_page, head_dim]
    batch: PagedBatch  # varlen: with query starts and the longest query
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write

    def _attend_written(self, layer: int, q: torch.Tensor, params: AttentionParams) -> torch.Tensor:
        return paged_attention(q, self.kv_pool, layer, self.batch, params)


@dataclass(slots=True)
class DenseContext:
    """Tokens laid out as ``batch`` rows of ``seq_len`` positions 0..seq_len-1."""

    batch: int
    seq_len: int
    window: int = 0
    key_start: int = 0  # positions below it are never attended (a row seeing none gives 0)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams
    ) -> torch.Tensor:
        q4, k4, v4 = (self._heads_first(t) for t in (q, k, v))  # [batch, heads, seq, hd]
        scale = params.scale
        if self.key_start > 0:
            mask = self.mask(q.device)
            out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=True)
            out = out.masked_fill(~mask.any(-1)[:, None], 0.0)  # rows with no key: NaN -> 0
        elif self.window > 0:
            out = F.scaled_dot_product_attention(
                q4, k4, v4, attn_mask=self.mask(q.device), scale=scale, enable_gqa=True
            )
        else:
            out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)
        out = out.transpose(1, 2)  # [batch, seq, heads, hd]
        if params.sinks is not None:
            mask = self.mask(q.device).expand(self.batch, -1, -1)
            out = out * sink_share(q4.transpose(1, 2), k4, mask, params)[..., None].to(out.dtype)
        return out.reshape(q.shape)

    def mask(self, device: torch.device) -> torch.Tensor:
        """[seq_len, seq_len] bool: query i sees key j iff i - window < j <= i (no lower
        bound for window 0) and j >= key_start."""
        i = torch.arange(self.seq_len, device=device)[:, None]
        j = torch.arange(self.seq_len, device=device)[None, :]
        mask = (j <= i) & (j >= self.key_start)
        return mask & (j > i - self.window) if self.window > 0 else mask

    def _heads_first(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.batch, self.seq_len, *t.shape[1:]).transpose(1, 2)


class Attention(nn.Module):
    """GQA self-attention with RoPE. ``input_size`` may differ from ``hidden_size``
    (the EAGLE-3 layer reads [embedding, hidden] concatenated). ``qkv_bias``/``o_bias``:
    biases on q/k/v and on o; ``qk_norm_eps`` set: q and k are RMS-normalised over
    head_dim, per head, before RoPE (Qwen3's ``q_norm``/``k_norm``). Under tensor
    parallelism this rank runs its share of the query heads and the KV heads they read
    (``num_heads``/``num_kv_heads`` are then per rank); o sums the shares."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        q_heads = split(num_heads, tp, "num_attention_heads")
        own_kv = kv_heads(num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = len(q_heads), len(own_kv), head_dim
        self.q_heads = q_heads
        self.params = AttentionParams(scale=head_dim**-0.5)
        self.sinks: nn.Parameter | None = None
        self.q_proj = ColumnParallelLinear(input_size, head_rows(q_heads, head_dim), qkv_bias)
        self.k_proj = ColumnParallelLinear(input_size, head_rows(own_kv, head_dim), qkv_bias)
        self.v_proj = ColumnParallelLinear(input_size, head_rows(own_kv, head_dim), qkv_bias)
        self.o_proj = RowParallelLinear(head_rows(q_heads, head_dim), hidden_size, tp, o_bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.qk_norm = qk_norm_eps is not None
        # (weight, bias) once merged
        self.qkv: tuple[torch.Tensor | Fp8Weight, torch.Tensor | None] | None = None

    SHARDED = ("sinks",)

    def add_sinks(self) -> None:
        """A learned sink logit per query head from now on (gpt-oss's ``self_attn.sinks``;
        this rank's heads): see :class:`AttentionParams`."""
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's heads of the checkpoint's per-head ``sinks``."""
        return full[self.q_heads.start : self.q_heads.stop]

    def merge(self) -> None:
        """Run q, k and v as one matmul from now on (fp8 ones, an fp8 checkpoint's, too)."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        if all(isinstance(p, Fp8Linear) for p in parts):
            self.qkv = merge_fp8(parts)
        else:
            self.qkv = merge_linears(parts)

    def quantize_fp8(self, mode: Fp8Mode = DRAFT) -> None:
        """Every projection's weight in fp8 from now on, as ``mode`` says (``fp8.py``); those
        already fp8 stay as they are."""
        if self.qkv is not None:
            merged, (self.q_proj, self.k_proj, self.v_proj) = fp8_merged(
                self.qkv[0], [self.q_proj, self.k_proj, self.v_proj], mode
            )
            self.qkv = (merged, self.qkv[1])
        else:
            self.q_proj, self.k_proj, self.v_proj = (
                fp8_linear_of(p, mode=mode) for p in (self.q_proj, self.k_proj, self.v_proj)
            )
        self.o_proj = fp8_linear_of(self.o_proj, mode=mode)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: KVContext, layer: int
    ) -> torch.Tensor:
        """x [num_tokens, input_size] -> [num_tokens, hidden_size]."""
        n = x.shape[0]
        params = self.params if self.sinks is None else replace(self.params, sinks=self.sinks)
        if self.qkv is not None and not self.qk_norm and isinstance(ctx, WritesPages):
            out = ctx.attend_packed(layer, self._merged_qkv(x), self.num_heads, rope, params)
        else:
            q, k, v = self._rotated_qkv(x, rope) if self.qkv is not None else self._separate_qkv(x, rope)
            out = ctx.attend(layer, q, k, v, params)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(n, -1))

    def _separate_qkv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return kernels.rotate_heads(q, *rope), kernels.rotate_heads(k, *rope), v

    def _merged_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, input_size] -> [n, num_heads + 2 * num_kv_heads, head_dim]: q heads, k heads,
        v heads from the one merged matmul, before RoPE."""
        heads = self.num_heads + 2 * self.num_kv_heads
        return linear(x, *self.qkv).view(x.shape[0], heads, self.head_dim)

    def _rotated_qkv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The merged path: one matmul; q and k rotated by one launch (after their norms)."""
        hq, hk = self.num_heads, self.num_kv_heads
        qkv = self._merged_qkv(x)
        qk = qkv[:, : hq + hk]
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])], dim=1)
        qk = kernels.rotate_heads(qk, *rope)  # [n, hq + hk, d]
        return qk[:, :hq], qk[:, hq:], qkv[:, hq + hk :]
