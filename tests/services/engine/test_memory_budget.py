"""services/engine/memory_budget.py: the KV budget under --gpu-memory-utilization, from
stated device readings (what memory_profile.py reads on a CUDA device)."""

from __future__ import annotations

import pytest

from services.engine.config import EngineConfig
from services.engine.memory_budget import (
    MIB,
    NON_TORCH_BYTES,
    MemoryReadings,
    check_free,
    describe_budget,
    group_line,
    kv_budget_bytes,
    profile_lengths,
    profile_tokens,
)

GIB = 1 << 30
# an 80 GiB device holding 16 GiB of weights; a profile forward that peaked 2 GiB above them
H100 = MemoryReadings(total=80 * GIB, weights=16 * GIB, activations=2 * GIB, graphs=2 * GIB)


def test_the_kv_cache_gets_what_the_fraction_leaves():
    assert H100.other == NON_TORCH_BYTES == GIB  # the stated estimate
    assert kv_budget_bytes(H100, 0.75) == 60 * GIB - 21 * GIB
    assert kv_budget_bytes(H100, 1.0) == 80 * GIB - 21 * GIB
    eager = MemoryReadings(total=80 * GIB, weights=16 * GIB, activations=2 * GIB, graphs=0, other=GIB // 2)
    assert kv_budget_bytes(eager, 0.5) == 40 * GIB - 16 * GIB - 2 * GIB - GIB // 2


def test_a_fraction_the_rest_fills_is_refused_naming_the_option_and_every_reading():
    with pytest.raises(ValueError) as e:
        kv_budget_bytes(H100, 0.25)  # 20 GiB of 80: 21 GiB go elsewhere
    assert str(e.value) == (
        "gpu_memory_utilization: 0.25 leaves no memory for the KV cache: 0.25 x 81920 MiB = 20480 MiB, "
        "less weights 16384, activations 2048, CUDA graphs 2048 (estimate), other 1024 (estimate: "
        "CUDA context, workspaces) = -1024 MiB for the KV cache; raise it, or lower "
        "--max-num-batched-tokens"
    )


def test_the_arithmetic_as_logged():
    assert describe_budget(H100, 0.75, 39 * GIB) == (
        "0.75 x 81920 MiB = 61440 MiB, less weights 16384, activations 2048, CUDA graphs 2048 "
        "(estimate), other 1024 (estimate: CUDA context, workspaces) = 39936 MiB for the KV cache"
    )


def test_the_worker_must_find_what_it_still_allocates_free():
    kv = kv_budget_bytes(H100, 0.75)  # 39 GiB, then 2 + 2 GiB of activations and graphs
    check_free(kv, H100, 43 * GIB, 0.75)
    with pytest.raises(ValueError) as e:
        check_free(kv, H100, 43 * GIB - 1, 0.75)  # another process holds the rest
    assert str(e.value).startswith(
        "gpu_memory_utilization: 0.75 of the device gives the KV cache 39936 MiB, and this worker "
        "needs 44032 MiB more in all, but only 44031 MiB of the device's 81920 MiB are free"
    )


@pytest.mark.parametrize(
    "budget, seqs, k, tokens",
    [(2048, 64, 4, 2048), (2048, 512, 4, 2560), (512, 256, 0, 512), (8192, 256, 7, 8192)],
)
def test_the_profile_runs_the_widest_step(budget, seqs, k, tokens):
    assert profile_tokens(budget, seqs, k) == tokens


@pytest.mark.parametrize(
    "tokens, max_model_len, lengths",
    [(2048, 32768, [2048]), (2048, 1024, [1023, 1023, 2]), (2046, 1024, [1023, 1023]), (5, 1, [1] * 5)],
)
def test_the_profile_splits_into_sequences_the_context_allows(tokens, max_model_len, lengths):
    assert profile_lengths(tokens, max_model_len) == lengths
    assert sum(lengths) == tokens


def test_one_line_per_layer_group():
    # 8B bf16 target: 32 layers x 2 x 8 KV heads x 16 tokens x 128 x 2 bytes = 2 MiB a page
    assert group_line("target", 52294, 16, 2 * MIB) == (
        "KV cache group target: 52294 pages, 836704 tokens, 104588.0 MiB"
    )


def test_the_engine_takes_a_fraction_on_cuda_only():
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: sizes the KV cache from a CUDA device's"):
        EngineConfig(model="m", gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: must be in \(0, 1\]"):
        EngineConfig(model="m", device="cuda", gpu_memory_utilization=1.2)
    assert EngineConfig(model="m", device="cuda", gpu_memory_utilization=0.9).gpu_memory_utilization == 0.9
