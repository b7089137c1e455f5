"""The drafter: an EAGLE-3-style head on top of the target.

KV convention (fixed; transfer and prefix caching rely on it): the drafter's slot at
position j is computed from the embedding of token t_j and a hidden row h_j:
- h_j = f_{j-1} = fc(concat of the target's low/mid/high layer outputs at j-1), zeros for
  j = 0, for every slot whose token is known (prompt, accepted tokens);
- h_j = g_{j-1}, the drafter's own output at j-1, for the speculative slots of a chain.
So a slot computed from true features depends only on tokens [0..j] and is cached by token
prefix like the target's KV. Slot 0 (t_0 with zeros) is written but is no key: attention
starts at ``DRAFT_KEY_START``. That is the published input-row convention (vLLM, SGLang,
SpecForge feed row p = (t_{p+1}, f_p) at position p and no leading row): slot j at position
j is their row j - 1, and RoPE only sees relative positions.

Tensor names follow the published EAGLE-3 layout: ``fc``, ``midlayer.*``, ``norm``, and
optionally ``lm_head`` with ``d2t``/``t2d`` (a reduced draft vocabulary) and
``embed_tokens``. Extra decoder layers, if any, are ``layers.{i}.*``.
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.models.attention import Attention, KVContext
from services.engine.models.config import NUM_AUX_LAYERS, EagleConfig
from services.engine.models.fp8 import DRAFT, fp8_linear_of, linear
from services.engine.models.layers import RMSNorm, Rotary, SwiGLU
from services.engine.models.llama import DecoderLayer
from services.engine.models.target import TargetModel
from services.engine.parallel import SINGLE, TensorParallel

DRAFT_KEY_START = 1  # first drafter position attended as a key (see the module docstring)


class Eagle3Layer(nn.Module):
    """Reads [input_layernorm(embedding), hidden_norm(hidden)] (2 * hidden_size wide);
    the residual stream starts from ``hidden``, or from hidden_norm(hidden) with
    ``norm_before_residual`` (SpecForge)."""

    def __init__(self, c: EagleConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(
            2 * c.hidden_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, tp=tp
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, tp)
        self.norm_before_residual = c.norm_before_residual

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: KVContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden [num_tokens, hidden_size] -> (MLP output, the stream before it),
        as :class:`DecoderLayer` returns them."""
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        base = normed if self.norm_before_residual else hidden
        h, residual = self.post_attention_layernorm.add(self.self_attn(x, rope, ctx, 0), base)
        return self.mlp(h), residual

    def merge(self) -> None:
        self.self_attn.merge()
        self.mlp.merge()

    def quantize_fp8(self) -> None:
        self.self_attn.quantize_fp8(DRAFT)
        self.mlp.quantize_fp8(DRAFT)


class Eagle3Drafter(nn.Module):
    """``tp``: the drafter's layers are sharded like the target's (its draft KV group
    too); ``fc``, the norms, the embedding and the LM head stay whole on every rank."""

    def __init__(
        self,
        config: EagleConfig,
        own_head: bool = False,
        own_embed: bool = False,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(NUM_AUX_LAYERS * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c, tp)
        self.layers = nn.ModuleList(DecoderLayer(c, tp) for _ in range(c.num_hidden_layers - 1))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling)
        own_head = own_head or c.draft_vocab_size < c.vocab_size
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False) if own_head else None
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embed else None
        if c.draft_vocab_size < c.vocab_size:
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Target features: aux [num_tokens, 3 * target_hidden_size] -> f [num_tokens,
        hidden_size]."""
        return self.fc(aux)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: KVContext,
        target: TargetModel,
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens]; hidden [num_tokens, hidden_size] (the h_j of
        the module docstring). Returns g [num_tokens, hidden_size], before the final norm."""
        return self.rotated(input_ids, hidden, self.rotary(positions), ctx, target)

    def rotated(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: KVContext,
        target: TargetModel,
    ) -> torch.Tensor:
        """``forward`` given its positions' ``rotary`` (cos, sin [num_tokens, 1, head_dim]),
        which the draft chain computes for all its steps at once."""
        embeds = self.embed_tokens(input_ids) if self.embed_tokens is not None else target.embed(input_ids)
        x, residual = self.midlayer(embeds, hidden.to(embeds.dtype), rope, ctx)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, ctx, i + 1)
        return x + residual

    def merge_projections(self) -> None:
        """As the target's ``merge_projections``, for the drafter's layers."""
        self.midlayer.merge()
        for layer in self.layers:
            layer.merge()

    def quantize_fp8(self) -> None:
        """Its own weights in fp8 from now on (``fp8.py``): fc, every layer's projections and
        its own LM head. What it shares with the target (embedding, LM head) stays as the
        target has it. Call after ``merge_projections``, if at all."""
        self.fc = fp8_linear_of(self.fc)
        self.midlayer.quantize_fp8()
        for layer in self.layers:
            layer.quantize_fp8(DRAFT)
        if self.lm_head is not None:
            self.lm_head = fp8_linear_of(self.lm_head)

    def compute_logits(self, g: torch.Tensor, target: TargetModel) -> torch.Tensor:
        """g [num_rows, hidden_size] -> [num_rows, vocab_size] float32 over target ids;
        ids outside a reduced draft vocabulary get -inf."""
        logits, ids = self.own_logits(g, target), self.target_ids()
        if ids is None:
            return logits
        full = logits.new_full((g.shape[0], self.config.vocab_size), float("-inf"))
        full[:, ids] = logits
        return full

    def own_logits(self, g: torch.Tensor, target: TargetModel) -> torch.Tensor:
        """g [num_rows, hidden_size] -> [num_rows, draft_vocab_size] float32: the logits over
        the drafter's own vocabulary, draft id i being target id ``target_ids()[i]``."""
        return self.own_head(g, target).float()

    def own_head(self, g: torch.Tensor, target: TargetModel) -> torch.Tensor:
        """``own_logits`` in the head's dtype, before the float32 cast (which is exact, so
        their argmax is the same)."""
        h = self.norm(g)
        if self.lm_head is None:
            return target.head(h)
        return linear(h, self.lm_head.weight, self.lm_head.bias)

    def target_ids(self) -> torch.Tensor | None:
        """[draft_vocab_size] int64: each draft id's target id (i + d2t[i]); None when the
        draft vocabulary is the target's."""
        if self.config.draft_vocab_size == self.config.vocab_size:
            return None
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
