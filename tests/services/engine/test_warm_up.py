"""The warm-up at start (services/engine/warm_up.py) leaves no trace: no request, no page,
no prefix-cache entry or counter, no speculative counter, no drawn id or seed; an engine
warmed up gives the same tokens as a fresh one, greedy and sampled, with and without the
drafter. (It runs by itself only on CUDA; here it is called directly.)"""

from __future__ import annotations

import pytest

from services.engine.sampling.params import SamplingParams
from services.engine.warm_up import LONG, warm_up
from tests.services.engine.helpers import assert_pools_empty, make_engine, random_prompts
from tests.services.engine.test_scheduling_policy import churn, params_for


@pytest.mark.parametrize("k", [0, 3])
def test_a_warmed_up_engine_is_a_fresh_engine(pair, k):
    prompts = random_prompts(9, seed=41, min_len=5, max_len=40)
    params = params_for(len(prompts))
    params[4] = SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)  # its seed: the engine's
    fresh = make_engine(pair, k=k, seed=5, scheduling_policy="mixed")  # CUDA's, for a target alone
    warmed = make_engine(pair, k=k, seed=5, scheduling_policy="mixed")
    ran = []
    warmed.step = spy(warmed.step, ran)
    warm_up(warmed)
    assert len(ran) > MIN_STEPS and {"prefill", "mixed", "decode"} <= set(ran)
    assert not warmed.requests and not warmed.progress.stats and warmed.last_step == ""
    assert warmed.cache_stats() == fresh.cache_stats()  # counters at zero, no page used
    assert churn(warmed, prompts, params) == churn(fresh, prompts, params)
    assert warmed.stats.keys() == fresh.stats.keys()
    for engine in (fresh, warmed):
        assert_pools_empty(engine)


MIN_STEPS = 1 + 4  # the first prompts' prefill, then the decode of 4 tokens at least


def spy(step, kinds: list[str]):
    def wrapped():
        out = step()
        kinds.append(step.__self__.last_step)
        return out

    return wrapped


@pytest.mark.parametrize("limit", [dict(max_model_len=LONG), dict(num_pages=(40, 40))])  # 160 tokens
def test_prompts_the_engine_cannot_hold_are_left_out(pair, limit):
    engine = make_engine(pair, k=2, **limit)  # the long prompt fits neither
    warm_up(engine)
    assert_pools_empty(engine)
