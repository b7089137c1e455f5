"""Reading Hugging Face ``config.json`` dicts: families, RoPE dialects, refusals.

Pure functions from a config dict to the values Tandem's configs hold. The rule for every
key of a supported family's transformers config: it is read, or checked against the value
that leaves the math unchanged (refused by name otherwise), or it changes nothing at
inference (dtype, use_cache, initializer_range, pad/bos ids, attention_dropout...). Keys
outside the family's transformers config are not read by transformers' model code either.
Every refusal is a ValueError ``"<field>: <value> is not supported; supported: ..."``.
"""

from __future__ import annotations

from typing import Any

TARGET_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
}
ATTENTION_OF = {"qwen3_moe": "qwen3", "mixtral": "mistral"}  # an MoE family's attention is its dense kin's
MOE_FAMILIES = (*ATTENTION_OF, "gpt_oss")
GPT_OSS_ALPHA = 1.702  # the clamped SwiGLU's sigmoid slope (kernels.reference.expert_activation)
DRAFTER_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
ROPE_KEYS = {  # rope type -> the scaling keys it reads (all required)
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
ROPE_OPTIONAL = {  # rope type -> the scaling keys it reads when given
    "yarn": ("beta_fast", "beta_slow", "truncate", "attention_factor", "mscale", "mscale_all_dim"),
}
FULL, SLIDING = "full_attention", "sliding_attention"
QWEN_MAX_WINDOW_LAYERS = 28  # transformers' default: Qwen2/3 layers from here on slide
NEUTRAL = {  # key -> (is the value neutral?, what is supported)
    "hidden_act": (lambda v: v in (None, "silu"), "silu"),
    "mlp_bias": (lambda v: not v, "false"),
    "partial_rotary_factor": (lambda v: v in (None, 1, 1.0), "1.0"),
    "quantization_config": (lambda v: v is None, "none (unquantized weights)"),
    "attn_logit_softcapping": (lambda v: v is None, "null"),
    "final_logit_softcapping": (lambda v: v is None, "null"),
    "use_mrope": (lambda v: not v, "false"),
    "rope_interleave": (lambda v: not v, "false"),
}


def refuse(field_name: str, value: Any, supported: str) -> None:
    raise ValueError(f"{field_name}: {value!r} is not supported; supported: {supported}")


def require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field_name}: {msg}")


def check_neutral(d: dict[str, Any], family: str = "") -> None:
    """Refuse the keys that change the math in a way Tandem does not implement. gpt-oss's
    published MXFP4 experts (``quant_method: mxfp4``) are dequantized at load (``mxfp4.py``)."""
    quant = d.get("quantization_config")
    if family == "gpt_oss" and isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        for key in set(quant) - {"quant_method", "modules_to_not_convert"}:
            refuse(f"quantization_config.{key}", quant[key], "quant_method, modules_to_not_convert")
        d = {k: v for k, v in d.items() if k != "quantization_config"}
    for key, (ok, supported) in NEUTRAL.items():
        if key in d and not ok(d[key]):
            refuse(key, d[key], supported)


def target_family(d: dict[str, Any], architectures: dict[str, str] = TARGET_ARCHITECTURES) -> str:
    """The model_type of a family ``architectures`` (architecture name -> model_type) holds;
    a config naming neither field is Llama (Tandem's own configs always name both)."""
    archs, model_type = d.get("architectures") or [], d.get("model_type")
    supported = ", ".join(architectures)
    if len(archs) != 1 and archs:
        refuse("architectures", archs, f"one of {supported}")
    if archs and archs[0] not in architectures:
        refuse("architectures", archs[0], supported)
    family = architectures[archs[0]] if archs else model_type or "llama"
    if family not in architectures.values():
        refuse("model_type", family, ", ".join(architectures.values()))
    if model_type is not None and model_type != family:
        refuse("model_type", model_type, f"{family!r} (architectures says {archs[0]})")
    return family


def check_drafter_family(d: dict[str, Any]) -> None:
    archs, model_type = d.get("architectures") or [], d.get("model_type")
    if archs and (len(archs) != 1 or archs[0] not in DRAFTER_ARCHITECTURES):
        refuse("architectures", archs if len(archs) != 1 else archs[0], ", ".join(DRAFTER_ARCHITECTURES))
    if model_type not in (None, "llama"):
        refuse("model_type", model_type, "llama")


def attention_family(family: str) -> str:
    """The dense family whose attention ``family`` has (itself for a dense one)."""
    return ATTENTION_OF.get(family, family)


def read_moe(d: dict[str, Any], family: str) -> dict[str, Any]:
    """The routed MLP's fields of an MoE family's config (none for a dense one): Qwen3-MoE
    reads ``num_experts`` (transformers 5: ``num_local_experts``), ``moe_intermediate_size``,
    ``norm_topk_prob`` (false if absent, as transformers), ``decoder_sparse_step`` and
    ``mlp_only_layers`` (dense layers of ``intermediate_size``); Mixtral reads
    ``num_local_experts`` (8 if absent), every layer routed over experts of
    ``intermediate_size``, the top k always renormalised. The router's training keys
    (aux loss, jitter noise, router logits) change nothing at inference."""
    if family not in MOE_FAMILIES:
        return {}
    experts = d.get("num_experts", d.get("num_local_experts"))
    k = d.get("num_experts_per_tok")
    if family == "gpt_oss":
        return gpt_oss_moe(d, experts, k)
    if family == "mixtral":
        return {
            "num_experts": 8 if experts is None else experts,
            "num_experts_per_tok": 2 if k is None else k,
            "moe_intermediate_size": d.get("intermediate_size") or 0,
            "norm_topk_prob": True,
        }
    return {
        "num_experts": 128 if experts is None else experts,
        "num_experts_per_tok": 8 if k is None else k,
        "moe_intermediate_size": d.get("moe_intermediate_size") or 0,
        "norm_topk_prob": bool(d.get("norm_topk_prob")),
        "decoder_sparse_step": d.get("decoder_sparse_step") or 1,
        "mlp_only_layers": tuple(d.get("mlp_only_layers") or ()),
    }


def gpt_oss_moe(d: dict[str, Any], experts: int | None, k: int | None) -> dict[str, Any]:
    """gpt-oss's routed MLP: ``num_local_experts`` (128 if absent) experts of
    ``intermediate_size``, ``num_experts_per_tok`` (the original ``experts_per_token``, 4 if
    absent) per token, the clamped SwiGLU at ``swiglu_limit`` (7.0 if absent) with the
    sigmoid slope 1.702 (any other ``swiglu_alpha`` is refused)."""
    alias = d.get("experts_per_token")
    if k is not None and alias is not None and k != alias:
        refuse("experts_per_token", alias, f"num_experts_per_tok's value {k}")
    alpha = d.get("swiglu_alpha", GPT_OSS_ALPHA)
    if alpha != GPT_OSS_ALPHA:
        refuse("swiglu_alpha", alpha, str(GPT_OSS_ALPHA))
    return {
        "num_experts": 128 if experts is None else experts,
        "num_experts_per_tok": k or alias or 4,
        "moe_intermediate_size": d.get("intermediate_size") or 0,
        "swiglu_limit": float(d.get("swiglu_limit") or 7.0),
    }


def gpt_oss_layer_types(d: dict[str, Any]) -> tuple[int, tuple[str, ...]]:
    """gpt-oss's window (``sliding_window``, 128 if absent) and layer types: ``layer_types``,
    or (as transformers) even layers sliding and odd ones full."""
    window = d.get("sliding_window") or 128
    types = d.get("layer_types")
    if types is None:
        types = [SLIDING if i % 2 == 0 else FULL for i in range(d.get("num_hidden_layers") or 0)]
    check_layer_types(types)
    return (window, tuple(types)) if SLIDING in types else (0, ())


def target_attention(d: dict[str, Any], family: str) -> tuple[int, tuple[str, ...]]:
    """The target's attention window in tokens (0 = full) and its per-layer mix: each
    layer's type, or () when every layer is alike (windowed iff the window is not 0):
    Mistral reads ``sliding_window`` (null = full) for every layer; Llama has no window;
    Qwen2/3 (:func:`qwen_layer_types`) attend fully unless ``use_sliding_window``. An MoE
    family reads as its attention's dense family (:func:`attention_family`)."""
    family = attention_family(family)
    if family == "gpt_oss":
        return gpt_oss_layer_types(d)
    if family in ("qwen2", "qwen3"):
        return qwen_layer_types(d)
    window = d.get("sliding_window") or 0
    if family == "llama" and window:
        refuse(
            "sliding_window", window, "null for LlamaForCausalLM (a windowed target is MistralForCausalLM)"
        )
    check_uniform_layer_types(d, SLIDING if window else FULL)
    return window, ()


def qwen_layer_types(d: dict[str, Any]) -> tuple[int, tuple[str, ...]]:
    """Qwen2/3's window and layer types, as transformers computes them: without
    ``use_sliding_window`` the window is dropped and every layer attends fully; with it,
    the layers ``layer_types`` names "sliding_attention" (when it is absent: layers
    ``max_window_layers`` (28 if absent) and up, when ``sliding_window`` is set) attend over
    ``sliding_window`` tokens. A mix without a sliding layer is full attention: (0, ())."""
    if not d.get("use_sliding_window"):
        check_uniform_layer_types(d, FULL)
        return 0, ()  # transformers drops sliding_window when use_sliding_window is false
    window, types = d.get("sliding_window") or 0, d.get("layer_types")
    if types is None:
        first = d.get("max_window_layers")
        first = QWEN_MAX_WINDOW_LAYERS if first is None else first
        types = [SLIDING if window and i >= first else FULL for i in range(d.get("num_hidden_layers") or 0)]
    check_layer_types(types)
    if SLIDING not in types:
        return 0, ()
    if not window:
        refuse("sliding_window", d.get("sliding_window"), f"a window in tokens for the {SLIDING!r} layers")
    return window, tuple(types)


def check_layer_types(types: list[str] | tuple[str, ...]) -> None:
    """Every entry of a per-layer mix is a type Tandem implements."""
    unknown = set(types) - {FULL, SLIDING}
    if unknown:
        refuse("layer_types", sorted(unknown), f"{FULL!r}, {SLIDING!r}")


def check_uniform_layer_types(d: dict[str, Any], layer_type: str) -> None:
    """A family without a per-layer mix: ``layer_types``, when given, names one type."""
    types = d.get("layer_types")
    if types is not None and any(t != layer_type for t in types):
        refuse("layer_types", sorted(set(types)), f"every layer {layer_type!r}")


def check_attention_bias(d: dict[str, Any], family: str) -> None:
    """``attention_bias`` (q/k/v/o biases) is read by Llama and Qwen3; Qwen2 has q/k/v
    biases and Mistral none whatever the key says, so there it may only be false."""
    family = attention_family(family)
    if family in ("qwen2", "mistral") and d.get("attention_bias"):
        refuse("attention_bias", True, f"false for {family} (its biases are fixed)")


def read_rope(d: dict[str, Any], layer_type: str = FULL) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from either dialect: transformers 4 (``rope_theta`` and
    ``rope_scaling``) or transformers 5 (``rope_parameters``, possibly keyed by layer
    type, in which case the entry for ``layer_type`` is read). Scaling is None for the
    default type, else canonical: ``{"rope_type": ..., <its keys>}``."""
    params = d.get("rope_parameters")
    if params is None:
        return float(d.get("rope_theta") or 10000.0), normalize_rope(d.get("rope_scaling"), "rope_scaling")
    if params and all(isinstance(v, dict) for v in params.values()):
        if layer_type not in params:
            refuse("rope_parameters", sorted(params), f"an entry for {layer_type!r}")
        params = params[layer_type]
    theta = params.get("rope_theta", d.get("rope_theta")) or 10000.0
    return float(theta), normalize_rope(params, "rope_parameters")


def read_layer_rope(d: dict[str, Any], layer_types: tuple[str, ...]) -> tuple[float, dict[str, Any] | None]:
    """:func:`read_rope` for a model whose layers are of ``layer_types``: one RoPE for all
    of them (per-layer-type parameters that differ are refused)."""
    ropes = [read_rope(d, t) for t in sorted(set(layer_types))]
    if any(r != ropes[0] for r in ropes):
        refuse("rope_parameters", d.get("rope_parameters"), "the same RoPE for every layer type")
    return ropes[0]


def normalize_rope(s: dict[str, Any] | None, field_name: str) -> dict[str, Any] | None:
    """Check a scaling dict (either spelling: ``rope_type`` or the older ``type``)."""
    if s is None:
        return None
    kind = s.get("rope_type", s.get("type", "default"))
    if kind not in ROPE_KEYS:
        refuse(f"{field_name}.rope_type", kind, ", ".join(ROPE_KEYS))
    optional = ROPE_OPTIONAL.get(kind, ())
    for key in set(s) - {"rope_type", "type", "rope_theta", *ROPE_KEYS[kind], *optional}:
        if not (key == "partial_rotary_factor" and s[key] in (1, 1.0)):
            refuse(f"{field_name}.{key}", s[key], f"the keys of {kind!r}: {ROPE_KEYS[kind]}")
    if kind == "default":
        return None
    for key in ROPE_KEYS[kind]:
        require(key in s, f"{field_name}.{key}", f"required by rope_type {kind!r}")
        require(float(s[key]) > 0, f"{field_name}.{key}", f"must be > 0, got {s[key]}")
    return {"rope_type": kind, **{k: s[k] for k in (*ROPE_KEYS[kind], *optional) if s.get(k) is not None}}


def aux_layers(d: dict[str, Any]) -> tuple[int, ...]:
    """Tandem's aux layer ids (the target layers, 0-based, whose *outputs* the drafter
    reads) from ``eagle_config``; () when it names none (defaults need the target).

    Published ``eagle_aux_hidden_state_layer_ids`` come in two conventions: "output of
    layer i" (the first id is 1) and "input to layer i" (the first id is 2; the same
    hidden state, numbered one higher). As SGLang does (PR #25454), a list whose first id
    is 1 is read as outputs and any other as inputs (each id minus 1). Tandem's own
    configs say which with ``eagle_aux_hidden_state_layer_convention``: "output" or
    "input"; it overrides the rule (an output list may start at 0)."""
    eagle = d.get("eagle_config") or {}
    known = (
        "eagle_aux_hidden_state_layer_ids",
        "eagle_aux_hidden_state_layer_convention",
        "use_aux_hidden_state",
    )
    for key in set(eagle) - set(known):
        refuse(f"eagle_config.{key}", eagle[key], ", ".join(known))
    if eagle.get("use_aux_hidden_state", True) is not True:
        refuse("eagle_config.use_aux_hidden_state", eagle["use_aux_hidden_state"], "true")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return ()
    convention = eagle.get("eagle_aux_hidden_state_layer_convention")
    if convention not in (None, "output", "input"):
        refuse("eagle_config.eagle_aux_hidden_state_layer_convention", convention, "output, input")
    if convention is None:
        convention = "output" if ids[0] == 1 else "input"
    return tuple(int(i) - (convention == "input") for i in ids)


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's and SGLang's default for a drafter that names no layers: the inputs of
    target layers (2, n // 2, n - 3), i.e. the outputs of (1, n // 2 - 1, n - 4)."""
    n = num_target_layers
    return (1, n // 2 - 1, n - 4)
