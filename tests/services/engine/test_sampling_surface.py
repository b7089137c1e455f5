"""top_k, min_p, penalties, min_tokens, logprobs and per-request num_spec_tokens.

Exact checks of each transform on hand-made logits, then the engine over the random pair
(vocabulary 32, EOS 31) against a dense target-only reference that applies the same rules
token by token, with and without speculation.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from services.engine.models import DenseContext, load_target, save_model
from services.engine.request import Request
from services.engine.row_sampling import row_params
from services.engine.sampler import Penalties, RowParams, apply_penalties, probs_for_rows
from services.engine.sampling import SamplingParams
from tests.services.engine.helpers import assert_pools_empty, make_engine, random_prompts, write_pair
from tests.services.engine.test_distribution import PROMPT, chi_square_passes
from tests.services.engine.test_engine import transfer

EOS = 31
INF = float("-inf")


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **{"max_tokens": 20, "ignore_eos": True, **kwargs})


# ---------------------------------------------------------------- transforms, exactly


def test_penalties_follow_vllm_and_openai():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    pen = Penalties(
        torch.tensor([0]),
        torch.tensor([2.0]),
        torch.tensor([0.5]),
        torch.tensor([0.25]),
        seen=torch.tensor([[True, True, False, False, True]]),
        counts=torch.tensor([[0.0, 3.0, 0.0, 0.0, 1.0]]),
    )
    out = apply_penalties(logits, pen)
    # repetition over seen tokens: 2 / 2, -2 * 2, 0.5 / 2; then output counts:
    # token 1: -4 - 0.25 * 3 - 0.5; token 4: 0.25 - 0.25 - 0.5
    assert out.tolist() == [[1.0, -5.25, 1.0, -1.0, -0.5]]
    assert logits.tolist() == [[2.0, -2.0, 1.0, -1.0, 0.5]]  # not modified


def test_top_k_and_min_p_keep_exactly_their_sets():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 4))
    params = RowParams(
        torch.ones(4),
        torch.ones(4),
        top_k=torch.tensor([2, 0, -1, 0]),
        min_p=torch.tensor([0.0, 0.6, 0.0, 0.3]),
    )
    probs = probs_for_rows(logits, params)
    expected = [
        [0.4 / 0.7, 0.3 / 0.7, 0, 0],
        [0.4 / 0.7, 0.3 / 0.7, 0, 0],
        [0.4, 0.3, 0.2, 0.1],
        [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0],
    ]
    assert torch.allclose(probs, torch.tensor(expected), atol=1e-6)


def test_top_k_one_is_the_argmax_and_greedy_reads_the_penalized_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert probs_for_rows(
        logits, RowParams(torch.ones(1), torch.ones(1), top_k=torch.tensor([1]))
    ).tolist() == [[0, 1, 0]]
    pen = Penalties(
        torch.tensor([0]),
        torch.tensor([4.0]),
        torch.zeros(1),
        torch.zeros(1),
        torch.tensor([[False, True, False]]),
        torch.zeros(1, 3),
    )
    greedy = RowParams(torch.zeros(1), torch.ones(1), penalties=pen)
    assert probs_for_rows(logits, greedy).tolist() == [[0, 0, 1]]  # 3 / 4 < 2


def test_rows_count_the_drafts_before_them_for_penalties_and_min_tokens():
    sp = SamplingParams(
        temperature=0.0, max_tokens=8, presence_penalty=1.0, min_tokens=3, stop_token_ids=(5,)
    )
    req = Request("r", [1, 2], sp, None)
    req.output_ids = [3]
    params = row_params([req], [[[], [4], [4, 4]]], 8, frozenset([EOS % 8]), "cpu")
    assert params.penalties.counts.tolist() == [
        [0, 0, 0, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 2, 0, 0, 0],
    ]
    assert params.penalties.seen[0].nonzero().flatten().tolist() == [1, 2, 3]
    # 1 and 2 tokens so far are < 3: EOS (7) and the stop id banned; 3 so far: free
    assert params.banned.nonzero().tolist() == [[0, 5], [0, 7], [1, 5], [1, 7]]
    ignored = Request("s", [1], SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True), None)
    assert row_params([ignored], [[[]]], 8, frozenset([7]), "cpu").banned is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_bad_new_fields_name_themselves(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(max_tokens=16, **kwargs)


# ---------------------------------------------------------------- a dense reference


@pytest.fixture(scope="module")
def target(pair):
    return load_target(pair[0])


@torch.no_grad()
def raw_logits(target, ids: list[int]) -> torch.Tensor:
    out = target(torch.tensor(ids), torch.arange(len(ids)), DenseContext(1, len(ids)))
    return target.compute_logits(out.hidden[-1:])[0]  # [vocab]


def reference_greedy(target, prompt: list[int], sp: SamplingParams) -> list[int]:
    """Target-only greedy decoding with the rules written out token by token."""
    out: list[int] = []
    while len(out) < sp.max_tokens:
        logits = raw_logits(target, prompt + out).double()
        if len(out) < sp.min_tokens:
            for t in ([] if sp.ignore_eos else [EOS]) + list(sp.stop_token_ids):
                logits[t] = INF
        for t in set(prompt + out):
            r = sp.repetition_penalty
            logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
        for t in set(out):
            logits[t] -= sp.frequency_penalty * out.count(t) + sp.presence_penalty
        out.append(int(logits.argmax()))
        if len(out) > sp.min_tokens and (
            (out[-1] == EOS and not sp.ignore_eos) or out[-1] in sp.stop_token_ids
        ):
            break
    return out


PENALIZED = [
    _greedy(repetition_penalty=1.6),
    _greedy(presence_penalty=1.5),
    _greedy(frequency_penalty=0.7),
    _greedy(repetition_penalty=1.3, presence_penalty=-0.5, frequency_penalty=1.2),
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
    plain = [o.token_ids for o in make_engine(pair, k=0).generate(prompts, _greedy())]
    assert sum(a != b for a, b in zip(got, plain, strict=True)) >= 4  # penalties bite
    if k:
        assert engine.stats["local"].num_accepted > 0
    assert_pools_empty(engine)


@pytest.mark.parametrize("k", [0, 2])
def test_min_tokens_holds_back_eos_and_stop_ids(pair, target, k):
    prompts = random_prompts(40, seed=15)
    full = make_engine(pair, k=0).generate(prompts, _greedy(max_tokens=24))
    i = next(i for i, o in enumerate(full) if EOS in o.token_ids[:10])
    first_eos = full[i].token_ids.index(EOS)
    sp = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=first_eos + 3)
    out = make_engine(pair, k=k).generate([prompts[i]], sp)[0]
    assert out.token_ids == reference_greedy(target, prompts[i], sp)
    assert EOS not in out.token_ids[: sp.min_tokens] and len(out.token_ids) > sp.min_tokens
    stop_id = full[i].token_ids[1]
    sp = _greedy(max_tokens=12, min_tokens=4, stop_token_ids=(stop_id,))
    out = make_engine(pair, k=k).generate([prompts[i]], sp)[0]
    assert out.token_ids == reference_greedy(target, prompts[i], sp)
    assert stop_id not in out.token_ids[:4]


def test_top_k_one_at_temperature_one_is_the_greedy_text(pair, prompts):
    greedy = [o.token_ids for o in make_engine(pair, k=0).generate(prompts, _greedy())]
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


# ---------------------------------------------------------------- logprobs


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
    sp = _greedy(max_tokens=16, logprobs=3, repetition_penalty=1.4)
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
        [[1, 2, 3]] * 2, [_greedy(max_tokens=5, logprobs=0), _greedy(max_tokens=5)]
    )
    assert len(with_lp.logprobs) == 5 and all(lp.top_ids == [] for lp in with_lp.logprobs)
    assert without.logprobs is None


def test_a_prefilled_request_continues_its_logprobs(pair):
    sp = _greedy(max_tokens=8, logprobs=2)
    prompt = [4, 9, 2, 7, 7, 1]
    reference = make_engine(pair, k=2).generate([prompt], sp)[0]
    prefill, decode = make_engine(pair, k=2), make_engine(pair, k=2)
    prefill.add_request(prompt, sp, "r", prefill_only=True)
    parked = list(_drain(prefill))[-1]
    assert parked.logprobs == reference.logprobs[:1]
    assert decode.reserve("r", len(prompt)) is not None
    transfer(prefill, decode, "r", len(prompt))
    prefill.release("r")
    decode.add_prefilled("r", prompt, parked.aux, sp)
    final = list(_drain(decode))[-1]
    assert final.token_ids == reference.token_ids
    assert final.logprobs[0] is None
    for x, y in zip(final.logprobs[1:], reference.logprobs[1:], strict=True):
        assert x.top_ids == y.top_ids and math.isclose(x.logprob, y.logprob, abs_tol=1e-5)


def _drain(engine):
    while engine.has_unfinished():
        yield from engine.step()


# ---------------------------------------------------------------- per-request num_spec_tokens


def test_num_spec_tokens_per_request_in_one_batch(pair, prompts):
    reference = [o.token_ids for o in make_engine(pair, k=0).generate(prompts, _greedy())]
    engine = make_engine(pair, k=4)
    ids = [
        engine.add_request(p, _greedy(), num_spec_tokens=[0, 2, None][i % 3]) for i, p in enumerate(prompts)
    ]
    final = {o.request_id: o for o in _drain(engine) if o.finished}
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
    reference = [o.token_ids for o in make_engine(pair, k=0).generate(prompts, _greedy())]
    engine = make_engine(pair, k=3)
    ids = [engine.add_request(p, _greedy(), num_spec_tokens=0) for p in prompts]
    final = {o.request_id: o for o in _drain(engine) if o.finished}
    assert [final[i].token_ids for i in ids] == reference
    assert all(final[i].usage.acceptance_length == 1.0 for i in ids)


def test_num_spec_tokens_past_k_is_refused(pair):
    engine = make_engine(pair, k=2)
    with pytest.raises(ValueError, match="^num_spec_tokens:"):
        engine.add_request([1, 2], _greedy(), num_spec_tokens=3)
    with pytest.raises(ValueError, match="^num_spec_tokens:"):
        make_engine(pair, k=0).add_request([1, 2], _greedy(), num_spec_tokens=1)


@pytest.mark.parametrize("k", [0, 3])
def test_min_tokens_lets_a_stop_string_count_only_after_their_text(pair, prompts, k):
    full = make_engine(pair, k=0).generate(prompts[:1], _greedy(max_tokens=24))[0].token_ids
    stop, m = chr(full[1]), 4  # one byte-level token per character; full[1] is protected
    j = next((j for j in range(m, len(full)) if full[j] == full[1]), None)
    out = make_engine(pair, k=k).generate(prompts[:1], _greedy(max_tokens=24, min_tokens=m, stop=(stop,)))[0]
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

    def probs_after(outputs: list[list[int]]) -> torch.Tensor:
        reqs = []
        for out in outputs:
            reqs.append(Request("x", PROMPT, sp, None))
            reqs[-1].output_ids = out
        ids = torch.tensor([PROMPT + out for out in outputs])
        b, t = ids.shape
        with torch.no_grad():
            hidden = target(ids.reshape(-1), torch.arange(t).repeat(b), DenseContext(b, t)).hidden
            logits = target.compute_logits(hidden.view(b, t, -1)[:, -1])
        return probs_for_rows(logits, row_params(reqs, [[[]]] * b, logits.shape[-1], frozenset([EOS]), "cpu"))

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
