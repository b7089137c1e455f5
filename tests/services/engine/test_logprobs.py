"""logprobs: the raw log-softmax of the target (before any transform), equal with and
without speculation, and continued across a prefill/decode hand-off."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.models import load_target, save_model
from tests.services.engine.helpers import make_engine, random_prompts, write_pair
from tests.services.engine.sampling_reference import drain, greedy_params, raw_logits
from tests.services.engine.test_engine import transfer


@pytest.fixture(scope="module")
def calm_pair(tmp_path_factory):
    """The random pair with the target's head scaled by 0.1: the same argmaxes, logits ten
    times smaller, so float32 differences between batch shapes stay far below 1e-5 (on the
    peaked pair even target-only batched vs alone differ by 1.4e-5)."""
    folder = tmp_path_factory.mktemp("calm")
    target_dir, drafter_dir = write_pair(folder)
    model = load_target(target_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.1)
    save_model(model, target_dir, dtype=torch.float32)
    return target_dir, drafter_dir


def test_logprobs_are_the_raw_log_softmax_and_equal_with_speculation(calm_pair):
    target = load_target(calm_pair[0])
    prompts = random_prompts(16, seed=22, min_len=3, max_len=30)
    sp = greedy_params(max_tokens=16, logprobs=3, repetition_penalty=1.4)
    plain = make_engine(calm_pair, k=0).generate(prompts, sp)
    engine = make_engine(calm_pair, k=3)
    spec = engine.generate(prompts, sp)
    assert engine.stats["local"].num_accepted > 0  # rows of accepted drafts are compared
    for a, b, prompt in zip(plain, spec, prompts, strict=True):
        assert a.token_ids == b.token_ids
        assert [lp.token_id for lp in a.logprobs] == a.token_ids
        for j, (x, y) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
            assert x.top_ids == y.top_ids and len(x.top_ids) == 3
            assert math.isclose(x.logprob, y.logprob, abs_tol=1e-5)
            assert all(
                math.isclose(u, v, abs_tol=1e-5) for u, v in zip(x.top_logprobs, y.top_logprobs, strict=True)
            )
            if j < 3:  # the raw distribution, before the penalty
                ref = torch.log_softmax(raw_logits(target, prompt + a.token_ids[:j]), -1)
                assert math.isclose(x.logprob, float(ref[x.token_id]), abs_tol=1e-5)
                assert x.top_ids == ref.topk(3).indices.tolist()


def test_logprobs_zero_gives_the_chosen_token_only_and_none_when_unset(pair):
    engine = make_engine(pair, k=2)
    with_lp, without = engine.generate(
        [[1, 2, 3]] * 2, [greedy_params(max_tokens=5, logprobs=0), greedy_params(max_tokens=5)]
    )
    assert len(with_lp.logprobs) == 5 and all(lp.top_ids == [] for lp in with_lp.logprobs)
    assert without.logprobs is None


def test_a_prefilled_request_continues_its_logprobs(pair):
    sp = greedy_params(max_tokens=8, logprobs=2)
    prompt = [4, 9, 2, 7, 7, 1]
    reference = make_engine(pair, k=2).generate([prompt], sp)[0]
    prefill, decode = make_engine(pair, k=2), make_engine(pair, k=2)
    prefill.add_request(prompt, sp, "r", prefill_only=True)
    parked = list(drain(prefill))[-1]
    assert parked.logprobs == reference.logprobs[:1]
    assert decode.reserve("r", len(prompt)) is not None
    transfer(prefill, decode, "r", len(prompt))
    prefill.release("r")
    decode.add_prefilled("r", prompt, parked.aux, sp)
    final = list(drain(decode))[-1]
    assert final.token_ids == reference.token_ids
    assert final.logprobs[0] is None
    for x, y in zip(final.logprobs[1:], reference.logprobs[1:], strict=True):
        assert x.top_ids == y.top_ids and math.isclose(x.logprob, y.logprob, abs_tol=1e-5)
