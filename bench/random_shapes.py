"""Shapes and config.json dicts of the random serving pair (``bench.random_model``).

``8b`` is Llama-3.1-8B's geometry (hidden 4096, 32 layers, 32 query / 8 KV heads, MLP 14336,
vocab 128256, rope_theta 500000 with llama3 scaling factor 8 / low 1 / high 4 / original
8192, 131072 positions, bf16, untied head) and an EAGLE-3 drafter shaped as the published
one for it (one mid layer over [embedding, hidden] 8192 wide, MLP 14336, its own LM head over
a 32,000-id draft vocabulary mapped by ``d2t``/``t2d``, no ``eagle_config``: the default aux
layers 1, 15, 28). ``tiny`` keeps every feature at a size a CPU test builds in a second.

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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS = {
    "8b": Shape(
        hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, draft_vocab=32000
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


def target_config(s: Shape) -> dict[str, Any]:
    """Llama-3.1's config.json keys (transformers 4 spelling) for ``s``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        **_common(s),
        "num_hidden_layers": s.layers,
        "mlp_bias": False,
    }


def drafter_config(s: Shape) -> dict[str, Any]:
    """The published EAGLE-3 config.json for a target of shape ``s``: one layer, its own head
    over ``draft_vocab`` ids, no ``eagle_config`` (default aux layers)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_common(s),
        "num_hidden_layers": 1,
        "draft_vocab_size": s.draft_vocab,
    }
