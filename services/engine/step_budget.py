"""The engine step's token budget when none is given: derived from the target and the device.

A prompt step's GEMMs do 2 FLOPs per linear weight per token, so the weights one token
passes through measure a model's prompt work per token. The budget gives a step about the
prompt work of ``REFERENCE_TOKENS`` tokens of an 8B-shaped Llama, per GPU of its tensor-
parallel group: the power of two at most ``REFERENCE_TOKENS * REFERENCE_WEIGHTS / weights``,
within ``[REFERENCE_TOKENS, LARGEST]``.

Why (docs/performance.md, "The step budget, served"): the 8B-shaped target at C=64 served
+1% tokens at 8,192 against 2,048 and a TTFT p50 3.4x longer (each mixed step's prompts wait
for all of them). The 9.6 MB tiny pair, whose prompt forwards are bound by the host (the
model's Python and torch's dispatch), served +36% at 8,192 with a shorter TTFT (+11-17% on
an H200): a larger step brings more prompts to one forward at almost no GPU cost. Not below
2,048: smaller budgets lost the 8B 13-43% of its tokens. A CPU's forward is bound by its
arithmetic at any size: ``CPU_BUDGET`` there.

Weights per token count the target's linear layers only (attention projections, the MLP, a
routed layer's ``num_experts_per_tok`` experts); embeddings and the head are left out (the
head runs on a prompt's last token only). Quantized weights (FP8) count as any other.
"""

from __future__ import annotations

from dataclasses import replace

from services.engine.config import EngineConfig
from services.engine.models.config import LlamaConfig

REFERENCE_TOKENS = 2048
# Llama-3.1-8B's linear weights a token passes: 32 layers of q, k, v, o and the SwiGLU MLP
REFERENCE_WEIGHTS = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
LARGEST = 8192
CPU_BUDGET = 2048


def linear_weights_per_token(c: LlamaConfig) -> int:
    """The target's linear weights one token passes through, all layers."""
    q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention = c.hidden_size * (2 * q_width + 2 * kv_width)
    total = 0
    for layer in range(c.num_hidden_layers):
        if c.routed(layer):
            mlp = c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size
        else:
            mlp = 3 * c.hidden_size * c.intermediate_size
        total += attention + mlp
    return total


def derived_step_budget(c: LlamaConfig, device_type: str, tp_size: int = 1) -> int:
    """Tokens a step runs for target ``c`` on ``device_type`` over ``tp_size`` GPUs: see the
    module's rule. 8B-shaped: 2,048; a 3B: 4,096; the tiny pair's 4.7M: 8,192."""
    if device_type != "cuda":
        return CPU_BUDGET
    per_gpu = max(1, linear_weights_per_token(c) // tp_size)
    tokens = REFERENCE_TOKENS * REFERENCE_WEIGHTS // per_gpu
    budget = REFERENCE_TOKENS
    while budget * 2 <= min(tokens, LARGEST):
        budget *= 2
    return budget


def with_step_budget(config: EngineConfig, target: LlamaConfig, device_type: str) -> EngineConfig:
    """``config`` with its token counts filled in: a ``max_num_batched_tokens`` of 0 becomes
    the derived budget, a ``max_prefill_chunk`` of 0 the step's budget (one prompt may take
    the whole step). Given counts are kept."""
    budget = config.max_num_batched_tokens or derived_step_budget(target, device_type, config.tp_size)
    return replace(
        config, max_num_batched_tokens=budget, max_prefill_chunk=config.max_prefill_chunk or budget
    )
