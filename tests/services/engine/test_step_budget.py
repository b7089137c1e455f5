"""The step's token budget derived from the target and the device (step_budget.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from bench.random_shapes import shape_from, target_config
from services.engine.config import EngineConfig
from services.engine.models.config import LlamaConfig, read_config_json
from services.engine.step_budget import (
    REFERENCE_WEIGHTS,
    derived_step_budget,
    linear_weights_per_token,
    with_step_budget,
)
from tests.services.engine.helpers import make_engine, write_pair

TINY_TARGET = Path(__file__).parents[3] / "models" / "tiny-target"


def preset(name: str, **overrides: int) -> LlamaConfig:
    return LlamaConfig.from_dict(target_config(shape_from(name, **overrides)))


def test_an_8b_shaped_llama_passes_the_reference_weights_and_keeps_2048():
    assert linear_weights_per_token(preset("8b")) == REFERENCE_WEIGHTS == 6_979_321_856
    assert derived_step_budget(preset("8b"), "cuda") == 2048


def test_a_routed_layer_counts_the_experts_a_token_goes_to():
    moe = preset("gpt-oss-20b")
    attention = 2880 * (2 * 64 * 64 + 2 * 8 * 64)
    assert linear_weights_per_token(moe) == 24 * (attention + 4 * 3 * 2880 * 2880)
    assert derived_step_budget(moe, "cuda") == 4096  # 3.03e9 weights: 4,716 tokens, down to a power of two


@pytest.mark.parametrize(
    ("layers", "tp", "budget"),
    [
        (32, 1, 2048),
        (64, 1, 2048),  # a larger model: never below 2,048
        (32, 2, 4096),  # each of two GPUs passes half the weights
        (16, 1, 4096),
        (4, 1, 8192),
        (1, 8, 8192),  # never above 8,192
    ],
)
def test_the_budget_is_the_8b_work_per_gpu_in_a_power_of_two(layers, tp, budget):
    assert derived_step_budget(preset("8b", layers=layers), "cuda", tp) == budget


def test_the_bundled_tiny_target_gets_the_largest_on_cuda_and_2048_on_cpu():
    tiny = LlamaConfig.from_dict(read_config_json(TINY_TARGET))
    assert linear_weights_per_token(tiny) == 6 * (256 * (2 * 256 + 2 * 128) + 3 * 256 * 768)
    assert derived_step_budget(tiny, "cuda") == 8192
    assert derived_step_budget(tiny, "cpu") == 2048


def test_zero_is_derived_and_given_counts_are_kept():
    tiny = LlamaConfig.from_dict(read_config_json(TINY_TARGET))
    derived = with_step_budget(
        EngineConfig(str(TINY_TARGET), max_num_batched_tokens=0, max_prefill_chunk=0), tiny, "cuda"
    )
    assert (derived.max_num_batched_tokens, derived.max_prefill_chunk) == (8192, 8192)
    chunked = with_step_budget(
        EngineConfig(str(TINY_TARGET), max_num_batched_tokens=0, max_prefill_chunk=512), tiny, "cuda"
    )
    assert (chunked.max_num_batched_tokens, chunked.max_prefill_chunk) == (8192, 512)
    given = with_step_budget(
        EngineConfig(str(TINY_TARGET), max_num_batched_tokens=96, max_prefill_chunk=0), tiny, "cuda"
    )
    assert (given.max_num_batched_tokens, given.max_prefill_chunk) == (96, 96)
    with pytest.raises(ValueError, match="max_num_batched_tokens: must be > 0, or 0 for derived, got -1"):
        EngineConfig(str(TINY_TARGET), max_num_batched_tokens=-1)


def test_an_engine_asked_for_no_budget_schedules_with_the_derived_one(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="services.engine.setup")
    engine = make_engine(write_pair(tmp_path), max_num_batched_tokens=0, max_prefill_chunk=0)
    assert "2048 tokens a step (derived from the model), 16 sequences" in caplog.text
    assert (engine.config.max_num_batched_tokens, engine.config.max_prefill_chunk) == (2048, 2048)
    assert (engine.scheduler.max_num_batched_tokens, engine.scheduler.max_prefill_chunk) == (2048, 2048)
    assert engine.manager.config.max_prefill_chunk == 2048
