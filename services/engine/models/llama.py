"""The target: a Llama-architecture decoder (RMSNorm, RoPE, GQA, SwiGLU), with the
family variants of :class:`LlamaConfig` (Qwen2 q/k/v bias, Qwen3 q/k norm, and the routed
experts of Qwen3-MoE and Mixtral in place of the SwiGLU, ``models/moe.py``; gpt-oss's
experts, attention sinks and biases, ``models/gpt_oss.py``). A window is
the KV context's: the model declares its layer groups (:meth:`LlamaForCausalLM.kv_layer_groups`:
one, windowed for Mistral; a full and a sliding one for a Qwen2/3 per-layer mix) and each
layer attends through its group's context.

Module names are the Hugging Face ones (``model.layers.3.self_attn.q_proj``...), so a
state dict loads from HF safetensors without renaming. Attention goes through a
:class:`KVContext`, so the same weights serve paged inference and dense training.
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine import kernels
from services.engine.models.attention import Attention, KVContext
from services.engine.models.config import LlamaConfig
from services.engine.models.fp8 import DRAFT, SERVE, Fp8Mode
from services.engine.models.gpt_oss import GptOssMlp
from services.engine.models.layer_contexts import GroupContext, LayerContexts
from services.engine.models.layers import RMSNorm, Rotary, SwiGLU
from services.engine.models.moe import MIXTRAL_EXPERT, QWEN_EXPERT, SparseMoe
from services.engine.models.target import KVLayerGroup, TargetOutput, layer_groups_by_window
from services.engine.parallel import SINGLE, TensorParallel

__all__ = ["DecoderLayer", "LlamaForCausalLM", "LlamaModel", "TargetOutput"]


def mlp_of(c: LlamaConfig, layer: int, tp: TensorParallel) -> tuple[str, nn.Module]:
    """Layer ``layer``'s MLP and the checkpoint's name for it: the dense SwiGLU ("mlp"), or
    the routed experts ("mlp" for Qwen3-MoE, "block_sparse_moe" for Mixtral)."""
    if not (isinstance(c, LlamaConfig) and c.routed(layer)):
        return "mlp", SwiGLU(c.hidden_size, c.intermediate_size, tp)
    if c.model_type == "gpt_oss":
        routing = (c.num_experts, c.num_experts_per_tok, c.swiglu_limit)
        return "mlp", GptOssMlp(c.hidden_size, c.moe_intermediate_size, routing, tp)
    routing = (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob)
    if c.model_type == "mixtral":
        return "block_sparse_moe", SparseMoe(
            c.hidden_size, c.moe_intermediate_size, routing, tp, MIXTRAL_EXPERT
        )
    return "mlp", SparseMoe(c.hidden_size, c.moe_intermediate_size, routing, tp, QWEN_EXPERT)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). ``c`` is a LlamaConfig or
    an EagleConfig (the drafter's extra layers); the MLP is layer ``layer``'s
    (:func:`mlp_of`), under the attribute name its checkpoint uses."""

    def __init__(self, c: LlamaConfig, tp: TensorParallel = SINGLE, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(
            c.hidden_size,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.qkv_bias,
            c.o_bias,
            c.rms_norm_eps if c.qk_norm else None,
            tp,
        )
        if getattr(c, "attention_sinks", False):
            self.self_attn.add_sinks()
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp_name, mlp = mlp_of(c, layer, tp)
        setattr(self, self.mlp_name, mlp)

    @property
    def feed_forward(self) -> nn.Module:
        """This layer's MLP, whatever its checkpoint name."""
        return getattr(self, self.mlp_name)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: KVContext,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous block's output; residual: the stream before it (None at the first
        layer, where x is the stream). Returns (this block's MLP output, the stream before
        it): the stream after the block is their sum, added by the next norm."""
        h, residual = self.input_layernorm.add(x, residual)
        h, residual = self.post_attention_layernorm.add(self.self_attn(h, rope, ctx, layer), residual)
        return self.feed_forward(h), residual

    def merge(self) -> None:
        self.self_attn.merge()
        self.feed_forward.merge()

    def quantize_fp8(self, mode: Fp8Mode = DRAFT) -> None:
        self.self_attn.quantize_fp8(mode)
        self.feed_forward.quantize_fp8(mode)


class LlamaModel(nn.Module):
    def __init__(self, c: LlamaConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, tp, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling)
        self.kv_groups = layer_groups_by_window(c.layer_windows(), c.num_key_value_heads, c.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: KVContext | LayerContexts,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> TargetOutput:
        contexts = ctx if isinstance(ctx, LayerContexts) else self._one_group(ctx)
        rope = self.rotary(positions)
        x, residual = self.embed_tokens(input_ids), None  # [num_tokens, hidden_size]
        kept = {}
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, *contexts.at(i))
            if i in aux_layer_ids:
                kept[i] = x + residual
        aux = [kept[i] for i in aux_layer_ids]
        hidden, _ = self.norm.add(x, residual)
        return TargetOutput(hidden, torch.cat(aux, dim=-1) if aux else None)

    def _one_group(self, ctx: KVContext) -> LayerContexts:
        """One context for every layer: a model of one layer group only."""
        if len(self.kv_groups) != 1:
            names = [g.name for g in self.kv_groups]
            raise ValueError(f"ctx: this model's layers form the groups {names}: pass one context each")
        group = self.kv_groups[0]
        return LayerContexts([GroupContext(group.name, group.layer_ids, ctx)])


class LlamaForCausalLM(nn.Module):
    """``tp``: this rank's share of a tensor-parallel group (see services/engine/parallel.py);
    the embedding and the LM head stay whole on every rank."""

    def __init__(self, config: LlamaConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, tp)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @property
    def head_weight(self) -> torch.Tensor:
        """[vocab_size, hidden_size]: the LM head (the embedding when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def merge_projections(self) -> None:
        """One q/k/v and one gate/up matmul per layer from now on (serving on a GPU); the
        parameters keep their checkpoint names and values."""
        for layer in self.model.layers:
            layer.merge()

    def quantize_fp8(self, mode: Fp8Mode = SERVE) -> None:
        """``--quantization fp8``: every layer's linears in fp8 from now on (``fp8.py``;
        routed experts keep their dtype with fp8-rounded values, ``moe.py``); the embedding
        and the LM head stay as loaded. Call after ``merge_projections``, if at all."""
        for layer in self.model.layers:
            layer.quantize_fp8(mode)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: KVContext | LayerContexts,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> TargetOutput:
        """input_ids, positions [num_tokens]; aux collects the listed layers' outputs. ``ctx``:
        one context per layer group (:meth:`kv_layer_groups`), or one for a single group."""
        return self.model(input_ids, positions, ctx, aux_layer_ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden_size] (final-normed) -> [num_rows, vocab_size] logits in
        the model's dtype; float32 logits are ``.float()`` of these, exactly."""
        return kernels.linear(hidden, self.head_weight)

    def kv_layer_groups(self) -> tuple[KVLayerGroup, ...]:
        """One group per distinct layer window (full attention first): every layer of a
        Llama, Qwen or Mistral config alike in one, a per-layer mix in two."""
        return self.model.kv_groups
