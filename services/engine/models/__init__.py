"""Target (Llama) and drafter (EAGLE-3) models, their configs and HF-folder loading."""

from services.engine.models.attention import DenseContext, PagedContext
from services.engine.models.config import EagleConfig, LlamaConfig
from services.engine.models.eagle import Eagle3Drafter
from services.engine.models.llama import LlamaForCausalLM, TargetOutput
from services.engine.models.loader import load_drafter, load_target, save_model

__all__ = [
    "DenseContext",
    "Eagle3Drafter",
    "EagleConfig",
    "LlamaConfig",
    "LlamaForCausalLM",
    "PagedContext",
    "TargetOutput",
    "load_drafter",
    "load_target",
    "save_model",
]
