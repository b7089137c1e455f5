"""Shapes and config.json dicts of the random serving pair (``bench.random_model``).

``8b`` is Llama-3.1-8B's geometry (hidden 4096, 32 layers, 32 query / 8 KV heads, MLP 14336,
vocab 128256, rope_theta 500000 with llama3 scaling factor 8 / low 1 / high 4 / original
8192, 131072 positions, bf16, untied head) and an EAGLE-3 drafter shaped as the published
one for it (one mid layer over [embedding, hidden] 8192 wide, MLP 14336, its own LM head over
a 32,000-id draft vocabulary mapped by ``d2t``/``t2d``, no ``eagle_config``: the default aux
layers 1, 15, 28). ``gpt-oss-20b`` is that model's geometry (hidden 2880, 24 layers, 64
query / 8 KV heads of 64, 32 experts of 2880 with 4 per token, even layers sliding over 128
tokens, attention sinks and biases, YaRN) in bf16 (its experts as transformers saves them
dequantized, not MXFP4). ``tiny`` and ``tiny-moe`` keep every feature at a size a CPU test
builds in a second.

Vocabulary: the folders carry the byte tokenizer (``models.byte_tokenizer``: ids 0-258), so
bos/eos are its ids 256/257. The model's 128256 ids are a superset: the tokenizer never
produces ids past 258, a token-id prompt may hold any id below vocab_size (the router checks
that bound), and ids the model emits past 258 are streamed as ids and decode to no text
(``tokenizers`` skips unknown ids; checked in tests/bench/test_random_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from models.byte_tokenizer import BOS_ID, EOS_ID

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True, slots=True)
class Shape:
    """A target's geometry and its drafter's. Counts are plain; ``head_dim`` = hidden /
    heads. ``draft_vocab`` < ``vocab``: the drafter's head covers that many target ids."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    draft_vocab: int
    max_positions: int = 131072
    experts: int = 0  # gpt-oss-shaped when > 0: routed experts of ``intermediate`` each
    top_k: int = 0
    window: int = 0  # the sliding layers' window (gpt-oss: even layers)
    head_size: int = 0  # 0 = hidden / heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


PRESETS = {
    "8b": Shape(
        hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, draft_vocab=32000
    ),
    "gpt-oss-20b": Shape(
        hidden=2880,
        layers=24,
        heads=64,
        kv_heads=8,
        intermediate=2880,
        vocab=201088,
        draft_vocab=32000,
        experts=32,
        top_k=4,
        window=128,
        head_size=64,
    ),
    "tiny-moe": Shape(
        hidden=128,
        layers=4,
        heads=4,
        kv_heads=2,
        intermediate=64,
        vocab=1024,
        draft_vocab=256,
        max_positions=8192,
        experts=4,
        top_k=2,
        window=16,
        head_size=32,
    ),
    "tiny": Shape(
        hidden=128,
        layers=8,
        heads=4,
        kv_heads=2,
        intermediate=256,
        vocab=1024,
        draft_vocab=256,
        max_positions=8192,
    ),
}


def shape_from(preset: str, **overrides: int | None) -> Shape:
    """The preset with every override that is not None applied (field names of Shape)."""
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


def _common(s: Shape) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(LLAMA3_ROPE),
        "max_position_embeddings": s.max_positions,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }


GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def target_config(s: Shape) -> dict[str, Any]:
    """Llama-3.1's config.json keys (transformers 4 spelling) for ``s``; gpt-oss's
    (transformers 5 spelling) for a shape with experts."""
    if s.experts:
        return gpt_oss_config(s)
    return {
        "architectures": ["LlamaForCausalLM"],
        **_common(s),
        "num_hidden_layers": s.layers,
        "mlp_bias": False,
    }


def gpt_oss_config(s: Shape) -> dict[str, Any]:
    """gpt-oss-20b's config.json keys for ``s``: biases, sinks, YaRN, even layers sliding."""
    common = _common(s)
    for key in ("rope_theta", "rope_scaling", "model_type"):
        common.pop(key)
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **common,
        "attention_bias": True,
        "num_hidden_layers": s.layers,
        "num_local_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "sliding_window": s.window,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.layers)],
        "swiglu_limit": 7.0,
        "rope_parameters": dict(GPT_OSS_ROPE),
    }


def drafter_config(s: Shape) -> dict[str, Any]:
    """The published EAGLE-3 config.json for a target of shape ``s``: one layer, its own head
    over ``draft_vocab`` ids, no ``eagle_config`` (default aux layers)."""
    common = _common(s)
    if s.experts:  # the drafter of a gpt-oss target: the target's RoPE, a plain attention
        common.pop("rope_scaling")
        common["rope_theta"] = GPT_OSS_ROPE["rope_theta"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **common,
        "num_hidden_layers": 1,
        "draft_vocab_size": s.draft_vocab,
    }
