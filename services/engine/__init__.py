"""The model runtime both worker roles share: target + EAGLE-3 drafter over the unified
paged KV cache, continuous batching, speculative decoding. See docs/engine.md."""

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.request import AuxState, RequestOutput
from services.engine.sampling import SamplingParams
from services.engine.stats import SpecStats, Usage

__all__ = ["AuxState", "Engine", "EngineConfig", "RequestOutput", "SamplingParams", "SpecStats", "Usage"]
