"""Model configurations read from Hugging Face-style ``config.json`` files.

Field names follow the HF Llama config, so a Llama, Qwen2, Qwen3 or Mistral
``config.json`` (transformers 4 or 5 spelling) parses as is; :mod:`.hf_config` reads the
dialects and refuses by name what Tandem does not implement. Missing keys take the HF
defaults.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from services.engine.models.hf_config import (
    FULL,
    MOE_FAMILIES,
    SLIDING,
    TARGET_ARCHITECTURES,
    attention_family,
    aux_layers,
    check_attention_bias,
    check_drafter_family,
    check_layer_types,
    check_neutral,
    default_aux_layers,
    normalize_rope,
    read_layer_rope,
    read_moe,
    read_rope,
    refuse,
    target_attention,
    target_family,
)
from services.engine.models.hf_config import require as _require
from services.engine.models.quant_config import without_fp8
from services.engine.models.target import TargetConfig

NUM_AUX_LAYERS = 3  # EAGLE-3 reads a low, a middle and a high target layer
ARCHITECTURE_OF = {family: arch for arch, family in TARGET_ARCHITECTURES.items()}
MOE_FIELDS = (
    "swiglu_limit",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Geometry of a Llama-architecture decoder. ``head_dim`` defaults to
    hidden_size // num_attention_heads; ``num_key_value_heads`` < heads means GQA.
    ``model_type`` is the family: llama and qwen3 have q/k/v/o biases iff
    ``attention_bias``, qwen2 has q/k/v biases and no o bias, qwen3 RMS-normalises q and
    k per head, mistral may attend over a window of ``sliding_window`` tokens, and qwen2 or
    qwen3 over that window in the layers ``layer_types`` names "sliding_attention" (a
    per-layer mix; () = every layer alike)."""

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
    model_type: str = "llama"
    sliding_window: int = 0  # tokens; 0 = full. A query at q sees keys in (q - W, q]
    layer_types: tuple[str, ...] = ()  # per layer, "full_attention" or "sliding_attention"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    num_experts: int = 0  # routed experts per MoE layer; 0 = a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the top k routing weights to sum 1
    decoder_sparse_step: int = 1  # layer i is routed iff (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    swiglu_limit: float = 0.0  # gpt-oss: its experts' clamp (0 = the plain SwiGLU)

    def __post_init__(self) -> None:
        _fill_heads(self)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _check_heads(self)
        if self.model_type not in ARCHITECTURE_OF:
            refuse("model_type", self.model_type, ", ".join(ARCHITECTURE_OF))
        _check_windows(self)
        _check_moe(self)
        if self.attention_bias and self.attention_family not in ("llama", "qwen3", "gpt_oss"):
            refuse("attention_bias", True, f"false for {self.model_type}")
        object.__setattr__(self, "rope_scaling", normalize_rope(self.rope_scaling, "rope_scaling"))

    @property
    def attention_family(self) -> str:
        """The dense family whose attention this model has (Qwen3-MoE: qwen3; Mixtral: mistral)."""
        return attention_family(self.model_type)

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def attention_sinks(self) -> bool:
        """Each attention head has a learned sink logit in its softmax (gpt-oss)."""
        return self.model_type == "gpt_oss"

    @property
    def qk_norm(self) -> bool:
        return self.attention_family == "qwen3"

    def routed(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the routed experts (else the dense SwiGLU)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def layer_windows(self) -> tuple[int, ...]:
        """Per layer, its attention window in tokens (0 = full attention)."""
        if not self.layer_types:
            return (self.sliding_window,) * self.num_hidden_layers
        return tuple(self.sliding_window if t == SLIDING else 0 for t in self.layer_types)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        family = target_family(d)
        check_neutral(without_fp8(d, family), family)
        check_attention_bias(d, family)
        window, layer_types = target_attention(d, family)
        theta, scaling = read_layer_rope(d, layer_types or (SLIDING if window else FULL,))
        return cls(
            **{
                **_known_fields(cls, d),
                "model_type": family,
                "sliding_window": window,
                "layer_types": layer_types,
                "rope_theta": theta,
                "rope_scaling": scaling,
                "head_dim": d.get("head_dim") or 0,
                "attention_bias": bool(d.get("attention_bias")) and family != "qwen2",
                **read_moe(d, family),
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """The config.json of this config; a per-layer mix says ``use_sliding_window``, as
        transformers reads it."""
        d = {"architectures": [ARCHITECTURE_OF[self.model_type]], **asdict(self)}
        moe = {key: d.pop(key) for key in MOE_FIELDS}
        if self.model_type in ("mixtral", "gpt_oss"):  # their experts' size is intermediate_size
            d.update(num_local_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"])
            if self.model_type == "gpt_oss":
                d.update(swiglu_limit=moe["swiglu_limit"], sliding_window=self.sliding_window)
        elif self.num_experts:
            d.update(
                {k: v for k, v in moe.items() if k != "swiglu_limit"},
                mlp_only_layers=list(moe["mlp_only_layers"]),
            )
        types = d.pop("layer_types")
        return {**d, "use_sliding_window": True, "layer_types": list(types)} if types else d


@dataclass(frozen=True, slots=True)
class EagleConfig:
    """An EAGLE-3 drafter. ``aux_layer_ids`` are the target layers (0-based) whose outputs
    (the residual stream after that layer) are concatenated, low/mid/high, and projected
    by ``fc`` (``3 * target_hidden_size`` -> ``hidden_size``); () until
    :meth:`check_target` fills in the defaults for a config that names none.
    ``sliding_window`` is the drafter's attention window in tokens (0 = full).
    ``draft_vocab_size`` < ``vocab_size`` means the drafter has its own LM head over a
    reduced vocabulary mapped to target ids by ``d2t``. ``norm_before_residual``: the
    mid layer's residual stream starts from hidden_norm(hidden) instead of hidden."""

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
    target_hidden_size: int = 0  # 0 = hidden_size
    norm_before_residual: bool = False

    qkv_bias = o_bias = qk_norm = False  # EAGLE-3 layers: no biases, no q/k norm

    def __post_init__(self) -> None:
        _fill_heads(self)
        if self.draft_vocab_size == 0:
            object.__setattr__(self, "draft_vocab_size", self.vocab_size)
        if self.target_hidden_size == 0:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "draft_vocab_size",
            "target_hidden_size",
        ):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _require(
            self.draft_vocab_size <= self.vocab_size,
            "draft_vocab_size",
            f"{self.draft_vocab_size} exceeds vocab_size {self.vocab_size}",
        )
        _check_heads(self)
        _require(self.sliding_window >= 0, "sliding_window", f"must be >= 0, got {self.sliding_window}")
        _require(
            len(self.aux_layer_ids) in (0, NUM_AUX_LAYERS),
            "aux_layer_ids",
            f"needs 3 target layers (low, mid, high), got {self.aux_layer_ids}",
        )
        object.__setattr__(self, "rope_scaling", normalize_rope(self.rope_scaling, "rope_scaling"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EagleConfig:
        """Tandem's configs and the published ones (the EAGLE authors', SpecForge's)."""
        check_drafter_family(d)
        check_neutral(without_fp8(d))
        for key in ("attention_bias", "tie_word_embeddings"):
            if d.get(key):
                refuse(key, d[key], "false")
        if d.get("num_aux_hidden_states", NUM_AUX_LAYERS) != NUM_AUX_LAYERS:
            refuse("num_aux_hidden_states", d["num_aux_hidden_states"], str(NUM_AUX_LAYERS))
        theta, scaling = read_rope(d)
        return cls(
            **{
                **_known_fields(cls, d),
                "aux_layer_ids": aux_layers(d),
                "rope_theta": theta,
                "rope_scaling": scaling,
                "sliding_window": d.get("sliding_window") or 0,
                "head_dim": d.get("head_dim") or 0,
                "draft_vocab_size": d.get("draft_vocab_size") or 0,
                "target_hidden_size": d.get("target_hidden_size") or 0,
                "norm_before_residual": bool(d.get("norm_before_residual")),
            }
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        ids = list(d.pop("aux_layer_ids"))
        if ids:
            d["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": ids,
                "eagle_aux_hidden_state_layer_convention": "output",
            }
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **d}

    def check_target(self, target: TargetConfig) -> EagleConfig:
        """This config checked against the target it drafts for, with the default aux
        layers (:func:`.hf_config.default_aux_layers`) filled in if it names none. The
        drafter reads the target's hidden states and embedding, and shares its vocabulary:
        its width is the target's (checked first: a drafter naming no ``target_hidden_size``
        reads its own width)."""
        _require(
            self.hidden_size == target.hidden_size,
            "drafter",
            f"hidden_size {self.hidden_size} differs from the target's {target.hidden_size}",
        )
        _require(
            self.target_hidden_size == target.hidden_size,
            "target_hidden_size",
            f"drafter reads {self.target_hidden_size}, target has {target.hidden_size}",
        )
        _require(
            self.vocab_size == target.vocab_size,
            "vocab_size",
            f"drafter {self.vocab_size} != target {target.vocab_size}",
        )
        ids = self.aux_layer_ids or default_aux_layers(target.num_hidden_layers)
        for i in ids:
            _require(
                0 <= i < target.num_hidden_layers,
                "aux_layer_ids",
                f"layer {i} not in the target's {target.num_hidden_layers} layers",
            )
        return replace(self, aux_layer_ids=ids)


def read_config_json(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"model_path: no config.json in {folder}")
    return json.loads(path.read_text())


def write_config_json(folder: str | Path, config: LlamaConfig | EagleConfig) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")


def _fill_heads(c: LlamaConfig | EagleConfig) -> None:
    if c.num_key_value_heads == 0:
        object.__setattr__(c, "num_key_value_heads", c.num_attention_heads)
    if c.head_dim == 0 and c.num_attention_heads > 0:
        object.__setattr__(c, "head_dim", c.hidden_size // c.num_attention_heads)


def _check_windows(c: LlamaConfig) -> None:
    """A window belongs to Mistral (every layer) or to a Qwen2/3 per-layer mix."""
    _require(c.sliding_window >= 0, "sliding_window", f"must be >= 0, got {c.sliding_window}")
    object.__setattr__(c, "layer_types", tuple(c.layer_types))
    if not c.layer_types:
        if c.sliding_window and c.attention_family != "mistral":
            refuse(
                "sliding_window",
                c.sliding_window,
                f"0 for {c.model_type} (a windowed target is model_type 'mistral', or a qwen2 "
                "or qwen3 one with layer_types)",
            )
        return
    if c.attention_family not in ("qwen2", "qwen3", "gpt_oss"):
        refuse("layer_types", list(c.layer_types), f"() for {c.model_type} (a mix is qwen2's or qwen3's)")
    _require(
        len(c.layer_types) == c.num_hidden_layers,
        "layer_types",
        f"has {len(c.layer_types)} entries for {c.num_hidden_layers} layers",
    )
    check_layer_types(c.layer_types)
    _require(c.sliding_window > 0, "sliding_window", f"must be > 0 for the {SLIDING!r} layers")


def _check_moe(c: LlamaConfig) -> None:
    """Routed experts belong to an MoE family, and their geometry is whole."""
    object.__setattr__(c, "mlp_only_layers", tuple(c.mlp_only_layers))
    if c.model_type not in MOE_FAMILIES:
        if c.num_experts:
            refuse("num_experts", c.num_experts, f"0 for {c.model_type} (a dense family)")
        return
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        _require(getattr(c, name) > 0, name, f"must be > 0, got {getattr(c, name)}")
    _require(
        c.num_experts_per_tok <= c.num_experts,
        "num_experts_per_tok",
        f"{c.num_experts_per_tok} exceeds num_experts {c.num_experts}",
    )
    outside = [i for i in c.mlp_only_layers if not 0 <= i < c.num_hidden_layers]
    _require(not outside, "mlp_only_layers", f"{outside} are not layers of {c.num_hidden_layers}")


def _check_heads(c: LlamaConfig | EagleConfig) -> None:
    _require(
        c.num_attention_heads % c.num_key_value_heads == 0,
        "num_key_value_heads",
        f"{c.num_key_value_heads} does not divide {c.num_attention_heads} heads",
    )
    _require(c.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {c.head_dim}")


def _known_fields(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    names = set(cls.__dataclass_fields__)
    return {k: v for k, v in d.items() if k in names}
