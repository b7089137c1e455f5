"""Warm-up at start: the first request of a new shape pays no compile.

Triton compiles a kernel the first time it meets a new set of constexprs, and specializes
integer arguments on being 1 or a multiple of 16; CUDA graphs are captured at engine start
(``device/cuda_graphs.py``), but the eager paths (prefill chunks, mixed steps, the sampler)
compile on first use. :func:`warm_up` runs a few greedy requests through the ordinary step
before the engine serves: prompts of 1, 16, 17 and a longer chunk's tokens, the last one
joining while the others decode, so prefill and decode steps run, and the step that has
both (one mixed forward or two, by the scheduling policy). A prompt the KV pool or context cannot take is
left out, never an error at start.

Invariant: nothing of it stays. Afterwards no request is held, every pool is empty, the
prefix cache and its counters, the speculative counters, the graphs' replay counters and
the adaptive-K state are as a fresh engine has them, and no request id or seed was drawn
from the engine's sequences.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from services.engine.sampling.params import SamplingParams

log = logging.getLogger(__name__)

LENGTHS = (1, 16, 17)  # Triton's integer specializations: 1, a multiple of 16, neither
LONG = 300  # the late joiner's prompt: a chunk of its own beside decode rows
MAX_TOKENS = 4  # tokens each warm-up request decodes (a verify step with drafts included)


class Warmable(Protocol):
    """What the warm-up asks of an engine (``Engine`` is one)."""

    max_model_len: int
    target: Any  # its config's vocab_size bounds the prompts' ids

    def add_request(self, prompt: list[int], sampling: SamplingParams, request_id: str) -> str: ...

    def step(self) -> list: ...

    def has_unfinished(self) -> bool: ...

    def forget_warm_up(self) -> None:
        """Everything finished requests left in the engine's state, back to a fresh engine's."""


def warm_up(engine: Warmable) -> float:
    """Run the warm-up requests to completion and leave no trace; returns its seconds."""
    start = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lengths = [n for n in (*LENGTHS, LONG) if n + MAX_TOKENS <= engine.max_model_len]
    vocab = engine.target.config.vocab_size
    prompts = [[(7 * j + 3) % vocab for j in range(n)] for n in lengths]
    for i, prompt in enumerate(prompts[:-1]):
        add(engine, prompt, params, f"warm-up-{i}")
    engine.step()  # the first prompts' prefill
    add(engine, prompts[-1], params, f"warm-up-{len(prompts) - 1}")
    while engine.has_unfinished():
        engine.step()
    engine.forget_warm_up()
    seconds = time.perf_counter() - start
    log.info("warm-up: %d requests of %s prompt tokens in %.2f s", len(prompts), lengths, seconds)
    return seconds


def add(engine: Warmable, prompt: list[int], params: SamplingParams, request_id: str) -> None:
    try:
        engine.add_request(prompt, params, request_id=request_id)
    except ValueError as e:  # does not fit this engine's KV pool: not a shape it will serve
        log.debug("warm-up: %d-token prompt left out: %s", len(prompt), e)
