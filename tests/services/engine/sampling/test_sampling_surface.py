"""The engine over the random pair (vocabulary 32, EOS 31) with penalties, min_tokens, top_k
and per-request num_spec_tokens, against a dense target-only reference that applies the
same rules token by token, with and without speculation; sampled with every transform, its
2nd and 3rd tokens follow the exact marginals."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from services.engine.models import load_target
from services.engine.sampling.params import SamplingParams
from tests.services.engine.helpers import assert_pools_empty, make_engine, random_prompts
from tests.services.engine.sampling.test_distribution import PROMPT, chi_square_passes
from tests.services.engine.sampling_reference import (
    EOS,
    drain,
    greedy_params,
    reference_greedy,
    transformed_probs_after,
)


@pytest.fixture(scope="module")
def target(pair):
    return load_target(pair[0])


PENALIZED = [
    greedy_params(repetition_penalty=1.6),
    greedy_params(presence_penalty=1.5),
    greedy_params(frequency_penalty=0.7),
    greedy_params(repetition_penalty=1.3, presence_penalty=-0.5, frequency_penalty=1.2),
]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, seed=21, min_len=3, max_len=20)


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_with_penalties_equals_the_dense_reference(pair, target, prompts, k):
    params = [PENALIZED[i % len(PENALIZED)] for i in range(len(prompts))]
    engine = make_engine(pair, k=k)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == [reference_greedy(target, p, s) for p, s in zip(prompts, params, strict=True)]
    plain = [o.token_ids for o in make_engine(pair, k=0).generate(prompts, greedy_params())]
    assert sum(a != b for a, b in zip(got, plain, strict=True)) >= 4  # penalties bite
    if k:
        assert engine.stats["local"].num_accepted > 0
    assert_pools_empty(engine)


@pytest.mark.parametrize("k", [0, 2])
def test_min_tokens_holds_back_eos_and_stop_ids(pair, target, k):
    prompts = random_prompts(40, seed=15)
    full = make_engine(pair, k=0).generate(prompts, greedy_params(max_tokens=24))
    i = next(i for i, o in enumerate(full) if EOS in o.token_ids[:10])
    first_eos = full[i].token_ids.index(EOS)
    sp = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=first_eos + 3)
    out = make_engine(pair, k=k).generate([prompts[i]], sp)[0]
    assert out.token_ids == reference_greedy(target, prompts[i], sp)
    assert EOS not in out.token_ids[: sp.min_tokens] and len(out.token_ids) > sp.min_tokens
    stop_id = full[i].token_ids[1]
    sp = greedy_params(max_tokens=12, min_tokens=4, stop_token_ids=(stop_id,))
    out = make_engine(pair, k=k).generate([prompts[i]], sp)[0]
    assert out.token_ids == reference_greedy(target, prompts[i], sp)
    assert stop_id not in out.token_ids[:4]


def test_top_k_one_at_temperature_one_is_the_greedy_text(pair, prompts):
    greedy = [o.token_ids for o in make_engine(pair, k=0).generate(prompts, greedy_params())]
    for k in (0, 3):
        params = [
            SamplingParams(temperature=1.0, top_k=1, seed=i, max_tokens=20, ignore_eos=True)
            for i in range(len(prompts))
        ]
        assert [o.token_ids for o in make_engine(pair, k=k).generate(prompts, params)] == greedy


def test_sampled_requests_with_every_transform_complete_and_reproduce(pair, prompts):
    params = [
        SamplingParams(
            temperature=0.8,
            top_k=8,
            min_p=0.05,
            top_p=0.9,
            seed=i,
            repetition_penalty=1.2,
            presence_penalty=0.3,
            min_tokens=5,
            frequency_penalty=0.2,
            max_tokens=16,
        )
        for i in range(len(prompts))
    ]
    a = [o.token_ids for o in make_engine(pair, k=3).generate(prompts, params)]
    b = [o.token_ids for o in make_engine(pair, k=3).generate(prompts, params)]
    assert a == b and all(len(t) > 5 for t in a)


# ---------------------------------------------------------------- per-request num_spec_tokens


def test_num_spec_tokens_per_request_in_one_batch(pair, prompts):
    reference = [o.token_ids for o in make_engine(pair, k=0).generate(prompts, greedy_params())]
    engine = make_engine(pair, k=4)
    ids = [
        engine.add_request(p, greedy_params(), num_spec_tokens=[0, 2, None][i % 3])
        for i, p in enumerate(prompts)
    ]
    final = {o.request_id: o for o in drain(engine) if o.finished}
    assert [final[i].token_ids for i in ids] == reference
    for i, rid in enumerate(ids):
        u = final[rid].usage
        if i % 3 == 0:
            assert u.acceptance_length == 1.0 and u.num_draft_tokens == 0
        elif i % 3 == 1:
            assert 1.0 <= u.acceptance_length <= 3.0 and u.num_draft_tokens == 2 * u.num_steps
        else:
            assert u.num_draft_tokens == 4 * u.num_steps
    assert sum(final[rid].usage.num_accepted for rid in ids) > 0
    assert_pools_empty(engine)


def test_num_spec_tokens_zero_for_the_whole_batch_keeps_the_drafter_exact(pair, prompts):
    reference = [o.token_ids for o in make_engine(pair, k=0).generate(prompts, greedy_params())]
    engine = make_engine(pair, k=3)
    ids = [engine.add_request(p, greedy_params(), num_spec_tokens=0) for p in prompts]
    final = {o.request_id: o for o in drain(engine) if o.finished}
    assert [final[i].token_ids for i in ids] == reference
    assert all(final[i].usage.acceptance_length == 1.0 for i in ids)


def test_num_spec_tokens_past_k_is_refused(pair):
    engine = make_engine(pair, k=2)
    with pytest.raises(ValueError, match="^num_spec_tokens:"):
        engine.add_request([1, 2], greedy_params(), num_spec_tokens=3)
    with pytest.raises(ValueError, match="^num_spec_tokens:"):
        make_engine(pair, k=0).add_request([1, 2], greedy_params(), num_spec_tokens=1)


@pytest.mark.parametrize("k", [0, 3])
def test_min_tokens_lets_a_stop_string_count_only_after_their_text(pair, prompts, k):
    full = make_engine(pair, k=0).generate(prompts[:1], greedy_params(max_tokens=24))[0].token_ids
    stop, m = chr(full[1]), 4  # one byte-level token per character; full[1] is protected
    j = next((j for j in range(m, len(full)) if full[j] == full[1]), None)
    out = make_engine(pair, k=k).generate(
        prompts[:1], greedy_params(max_tokens=24, min_tokens=m, stop=(stop,))
    )[0]
    assert j is not None  # without min_tokens the stop string ends it at token 2
    assert out.finish_reason == "stop" and out.token_ids == full[: j + 1]
    assert out.text == "".join(chr(t) for t in full[:j])


def test_speculative_sampling_with_every_transform_follows_the_target(pair, target):
    """Chi-square of the 2nd and 3rd tokens of 1500 seeded requests (K = 2: verify rows,
    accepted, recovered and bonus tokens) against the exact marginals, each next-token
    distribution computed densely with the transforms over that prefix's outputs."""
    sp = SamplingParams(
        temperature=1.5,
        top_k=12,
        min_p=0.02,
        repetition_penalty=1.3,
        presence_penalty=0.8,
        frequency_penalty=0.5,
        min_tokens=2,
        max_tokens=3,
    )
    probs_after = functools.partial(transformed_probs_after, target, PROMPT, sp)
    vocab = 32
    p1 = probs_after([[]])[0]
    p2 = probs_after([[a] for a in range(vocab)])  # [a, b]
    p3 = probs_after([[a, b] for a in range(vocab) for b in range(vocab)])  # [a * b, c]
    joint12 = p1[:, None] * p2
    second, third = joint12.sum(0), (joint12.reshape(-1, 1) * p3).sum(0)
    n = 1500
    engine = make_engine(pair, k=2, max_num_seqs=128, num_pages=(1024, 1024), max_num_batched_tokens=1024)
    params = [dataclasses.replace(sp, seed=s) for s in range(n)]
    tokens = torch.tensor([o.token_ids for o in engine.generate([PROMPT] * n, params)])
    stats = engine.stats["local"]
    assert 0 < stats.num_accepted < stats.num_draft_tokens
    assert chi_square_passes(torch.bincount(tokens[:, 1], minlength=vocab).float(), second)
    assert chi_square_passes(torch.bincount(tokens[:, 2], minlength=vocab).float(), third)


def test_a_temperature_below_the_floor_decodes_as_greedy(pair, prompts):
    """1e-38 overflowed logits / temperature to NaN, which sampled token 0 (a NUL byte)."""
    engine = make_engine(pair, k=2)
    tiny = SamplingParams(temperature=1e-38, max_tokens=12, ignore_eos=True, seed=3)
    got = [o.token_ids for o in engine.generate(prompts[:2], tiny)]
    greedy = dataclasses.replace(tiny, temperature=0.0)
    assert got == [o.token_ids for o in make_engine(pair, k=2).generate(prompts[:2], greedy)]
    assert_pools_empty(engine)
