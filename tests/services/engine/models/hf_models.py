"""Random small checkpoints saved by ``transformers`` (the reference), and Tandem's
dense forward over them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from services.engine.models import LlamaForCausalLM, dense_contexts

VOCAB = 256
GEOMETRY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
}
MOE = {  # small routed MLPs: 4 experts, 2 per token, each of intermediate size 32
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "gpt_oss": dict(  # a 16-token window on layers 0 and 2, YaRN as published (scaled down)
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_hidden_layers=4,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
    ),
}


def layer_mix(window: int) -> dict:
    """Qwen2/3 config keys of 4 layers alternating a ``window``-token sliding window (layers
    0 and 2) and full attention (layers 1 and 3)."""
    return {
        "num_hidden_layers": 4,
        "use_sliding_window": True,
        "sliding_window": window,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (biases too: transformers initialises them to zero), norms
    near 1, so each tensor matters to the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def hf_checkpoint(
    folder: Path, family: str, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> transformers.PreTrainedModel:
    """A random ``family`` model saved to ``folder`` by ``save_pretrained``, float32."""
    config_cls, model_cls = CLASSES[family]
    config = config_cls(**{**GEOMETRY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


def prompt(n: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def hf_logits(model: transformers.PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """[n, vocab] float32 logits of transformers' own forward."""
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def tandem_logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """[n, vocab]: the dense path, each layer group with its window."""
    n = ids.shape[0]
    ctx = dense_contexts(model.kv_layer_groups(), batch=1, seq_len=n)
    with torch.no_grad():
        out = model(ids, torch.arange(n), ctx)
        return model.head(out.hidden).float()


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def write_config(folder: Path, d: dict) -> None:
    (folder / "config.json").write_text(json.dumps(d, indent=2))


def to_transformers4(d: dict) -> dict:
    """A transformers-5 config rewritten in transformers-4 spelling: ``rope_theta`` at the
    top, scaling (if any) in ``rope_scaling``."""
    d = dict(d)
    params = dict(d.pop("rope_parameters"))
    d["rope_theta"] = params.pop("rope_theta")
    d["rope_scaling"] = None if params.get("rope_type") == "default" else params
    return d
