"""The target families Tandem serves: one line per Hugging Face architecture name.

Each line gives the family's ``model_type``, its config reader (a ``config.json`` dict to
the model's config, refusing by name what the family's code does not implement) and its
model class (``(config, tp)`` to a :class:`~services.engine.models.target.TargetModel`).
Adding a family: its model file, its config reader, and one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.engine.models.config import LlamaConfig
from services.engine.models.hf_config import target_family
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.target import TargetModel
from services.engine.parallel import TensorParallel


@dataclass(frozen=True, slots=True)
class TargetFamily:
    model_type: str
    read_config: Callable[[dict[str, Any]], Any]
    model: Callable[[Any, TensorParallel], TargetModel]


TARGET_FAMILIES: dict[str, TargetFamily] = {
    "LlamaForCausalLM": TargetFamily("llama", LlamaConfig.from_dict, LlamaForCausalLM),
    "Qwen2ForCausalLM": TargetFamily("qwen2", LlamaConfig.from_dict, LlamaForCausalLM),
    "Qwen3ForCausalLM": TargetFamily("qwen3", LlamaConfig.from_dict, LlamaForCausalLM),
    "MistralForCausalLM": TargetFamily("mistral", LlamaConfig.from_dict, LlamaForCausalLM),
    "Qwen3MoeForCausalLM": TargetFamily("qwen3_moe", LlamaConfig.from_dict, LlamaForCausalLM),
    "MixtralForCausalLM": TargetFamily("mixtral", LlamaConfig.from_dict, LlamaForCausalLM),
    "GptOssForCausalLM": TargetFamily("gpt_oss", LlamaConfig.from_dict, LlamaForCausalLM),
}


def family_of(d: dict[str, Any]) -> TargetFamily:
    """The family a target's ``config.json`` names: by its one ``architectures`` entry, else
    by its ``model_type``, else Llama. Any other is refused by name."""
    model_type = target_family(d, {arch: f.model_type for arch, f in TARGET_FAMILIES.items()})
    return next(f for f in TARGET_FAMILIES.values() if f.model_type == model_type)
