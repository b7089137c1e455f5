"""Target models (the families of ``registry.py``, behind the ``TargetModel`` protocol) and
the drafter (EAGLE-3), their configs and HF-folder loading."""

from services.engine.models.attention import DenseContext, PagedContext
from services.engine.models.config import EagleConfig, LlamaConfig
from services.engine.models.eagle import Eagle3Drafter
from services.engine.models.layer_contexts import GroupContext, LayerContexts, dense_contexts, layer_contexts
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.loader import load_drafter, load_target, save_model
from services.engine.models.registry import TARGET_FAMILIES
from services.engine.models.target import (
    KVLayerGroup,
    TargetConfig,
    TargetModel,
    TargetOutput,
    model_dtype,
)

__all__ = [
    "TARGET_FAMILIES",
    "DenseContext",
    "Eagle3Drafter",
    "EagleConfig",
    "GroupContext",
    "KVLayerGroup",
    "LayerContexts",
    "LlamaConfig",
    "LlamaForCausalLM",
    "PagedContext",
    "TargetConfig",
    "TargetModel",
    "TargetOutput",
    "dense_contexts",
    "layer_contexts",
    "load_drafter",
    "load_target",
    "model_dtype",
    "save_model",
]
