"""The model runtime both worker roles share: target + EAGLE-3 drafter over the unified
paged KV cache, continuous batching, speculative decoding. See docs/engine.md.

The names below are exported lazily (PEP 562): importing a light submodule such as
``services.engine.sampling.params`` does not load the engine, its models and torch with it. The
aux state a prefilled request carries is kvcore's (``kvcore.AuxState``)."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "services.engine.engine",
    "EngineConfig": "services.engine.config",
    "RequestOutput": "services.engine.request",
    "SamplingParams": "services.engine.sampling.params",
    "SpecStats": "services.engine.stats",
    "Usage": "services.engine.stats",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
