"""Model configurations read from Hugging Face-style ``config.json`` files.

Field names follow the HF Llama config, so a real Llama/Qwen-class ``config.json`` parses
as is. Unknown keys are ignored; missing keys take the HF defaults.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROPE_SCALING_TYPES = ("linear", "llama3")


def _require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field_name}: {msg}")


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Geometry of a Llama-architecture decoder. ``head_dim`` defaults to
    hidden_size // num_attention_heads; ``num_key_value_heads`` < heads means GQA."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 0  # 0 = num_attention_heads
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int = 0  # tokens; 0 = full. A query at q sees keys in (q - W, q]
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads == 0:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim == 0 and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "head_dim", "max_position_embeddings"):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 f"{self.num_key_value_heads} does not divide {self.num_attention_heads} heads")
        _require(self.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {self.head_dim}")
        _require(self.sliding_window >= 0, "sliding_window", f"must be >= 0, got {self.sliding_window}")
        check_rope_scaling(self.rope_scaling)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        d = dict(d)
        d["sliding_window"] = d.get("sliding_window") or 0  # Mistral writes null for none
        return cls(**_known_fields(cls, d))

    def to_dict(self) -> dict[str, Any]:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **asdict(self)}


@dataclass(frozen=True, slots=True)
class EagleConfig:
    """An EAGLE-3 drafter. ``aux_layer_ids`` are the target layers whose outputs (the
    residual stream after that layer) are concatenated, low/mid/high, and projected by
    ``fc``. ``sliding_window`` is the drafter's attention window in tokens (0 = full).
    ``draft_vocab_size`` < ``vocab_size`` means the drafter has its own LM head over a
    reduced vocabulary mapped to target ids by ``d2t``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int = 1
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    draft_vocab_size: int = 0  # 0 = vocab_size
    sliding_window: int = 0
    aux_layer_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.num_key_value_heads == 0:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim == 0 and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.draft_vocab_size == 0:
            object.__setattr__(self, "draft_vocab_size", self.vocab_size)
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "head_dim", "draft_vocab_size"):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _require(self.draft_vocab_size <= self.vocab_size, "draft_vocab_size",
                 f"{self.draft_vocab_size} exceeds vocab_size {self.vocab_size}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 f"{self.num_key_value_heads} does not divide {self.num_attention_heads} heads")
        _require(self.sliding_window >= 0, "sliding_window", f"must be >= 0, got {self.sliding_window}")
        _require(len(self.aux_layer_ids) == 3, "aux_layer_ids",
                 f"needs 3 target layers (low, mid, high), got {self.aux_layer_ids}")
        check_rope_scaling(self.rope_scaling)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EagleConfig:
        d = dict(d)
        eagle = d.get("eagle_config") or {}
        if "eagle_aux_hidden_state_layer_ids" in eagle:
            d["aux_layer_ids"] = tuple(eagle["eagle_aux_hidden_state_layer_ids"])
        d["sliding_window"] = d.get("sliding_window") or 0
        return cls(**_known_fields(cls, d))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(d.pop("aux_layer_ids"))}
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **d}

    def check_target(self, target: LlamaConfig) -> None:
        """The drafter reads the target's hidden states and shares its vocabulary."""
        _require(self.hidden_size == target.hidden_size, "hidden_size",
                 f"drafter {self.hidden_size} != target {target.hidden_size}")
        _require(self.vocab_size == target.vocab_size, "vocab_size",
                 f"drafter {self.vocab_size} != target {target.vocab_size}")
        for i in self.aux_layer_ids:
            _require(0 <= i < target.num_hidden_layers, "aux_layer_ids",
                     f"layer {i} not in the target's {target.num_hidden_layers} layers")


def check_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
    if rope_scaling is None:
        return
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    _require(kind in ROPE_SCALING_TYPES or kind == "default", "rope_scaling",
             f"type {kind!r} is not supported; known: {ROPE_SCALING_TYPES}")
    if kind != "default":
        _require(float(rope_scaling.get("factor", 0)) > 0, "rope_scaling",
                 "factor must be > 0")


def read_config_json(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"model_path: no config.json in {folder}")
    return json.loads(path.read_text())


def write_config_json(folder: str | Path, config: LlamaConfig | EagleConfig) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")


def _known_fields(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    names = set(cls.__dataclass_fields__)
    return {k: v for k, v in d.items() if k in names}
