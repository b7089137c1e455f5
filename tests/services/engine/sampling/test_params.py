"""Sampler, rejection sampler and sampling parameters: exact cases and distributions."""

from __future__ import annotations

import pytest
import torch

from services.engine.sampling.noise import DRAFT, TARGET
from services.engine.sampling.params import MIN_TEMPERATURE, SamplingParams
from services.engine.sampling.sampler import probs_from_logits, sample, top_p_filter, two_pass_argmax
from services.engine.speculation.rejection import Draws, rejection_sample

CHI2_DF5_P001 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    probs = torch.tensor([[0.2, 0.5, 0.3], [0.2, 0.5, 0.3], [0.2, 0.5, 0.3]])
    out = top_p_filter(probs, torch.tensor([0.5, 0.6, 1.0]))
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.625, 0.375], [0.2, 0.5, 0.3]]))


def test_greedy_rows_are_one_hot_and_sample_to_the_argmax():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    probs = probs_from_logits(logits, torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], -1))
    for seed in range(50):  # one-hot rows give their hot index whatever the draw
        assert sample(probs[:1], torch.tensor([seed]), torch.tensor([3]), TARGET).tolist() == [1]


def one_hot(ids: list[int], vocab: int = 5) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


@pytest.mark.parametrize(
    "drafts,accepted,next_token",
    [
        ([3, 1], 2, 2),  # both drafts match: bonus = target argmax at position 2
        ([3, 0], 1, 1),  # second draft rejected: the target's token there
        ([4, 1], 0, 3),  # first draft rejected
    ],
)
def test_greedy_verification_is_exact(drafts, accepted, next_token):
    target = one_hot([3, 1, 2])[None]  # [1, K + 1, vocab]
    draws = Draws(torch.tensor([0]), torch.tensor([7]))
    verdict = rejection_sample(target, one_hot(drafts)[None], torch.tensor([drafts]), draws)
    assert verdict.num_accepted.tolist() == [accepted]
    assert verdict.next_tokens.tolist() == [next_token]


def test_speculative_sampling_follows_the_target_distribution():
    """K = 2 over a 6-token vocabulary, 20000 fixed-seed trials: the first emitted token
    follows p_0, and the second (when the first was an accepted draft) follows p_1."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 6, generator=g) * 1.5, -1)  # target at positions 0..2
    q = torch.softmax(torch.randn(2, 6, generator=g) * 1.5, -1)  # drafter at positions 0..1
    n = 20000
    draws = Draws(torch.arange(1000, 1000 + n), torch.full((n,), 40))  # t_n at position 40
    drafts = torch.stack(
        [sample(q[i].expand(n, 6), draws.seeds, draws.starts + i + 1, DRAFT) for i in range(2)], dim=1
    )  # [n, 2]
    verdict = rejection_sample(p.expand(n, 3, 6), q.expand(n, 2, 6), drafts, draws)
    a = verdict.num_accepted
    first = torch.where(a >= 1, drafts[:, 0], verdict.next_tokens)
    second = torch.where(a >= 2, drafts[:, 1], verdict.next_tokens)[a >= 1]
    assert chi_square(torch.bincount(first, minlength=6).float(), p[0]) < CHI2_DF5_P001
    assert chi_square(torch.bincount(second, minlength=6).float(), p[1]) < CHI2_DF5_P001
    # the acceptance rate of the first draft is sum(min(p, q))
    rate = float((a >= 1).float().mean())
    assert abs(rate - float(torch.minimum(p[0], q[0]).sum())) < 0.02


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ("x",) * 17}, "stop"),
        ({"stop": ("x" * 257,)}, "stop"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_a_temperature_below_the_floor_is_greedy_and_the_floor_itself_samples_finite_probs():
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=9e-6).temperature == 0
    floor = SamplingParams(temperature=MIN_TEMPERATURE)
    assert not floor.greedy
    logits = torch.tensor([[30.0, 29.99, -5.0, 0.0]])
    probs = probs_from_logits(logits, torch.tensor([floor.temperature]), torch.tensor([1.0]))
    assert bool(torch.isfinite(probs).all()) and float(probs.sum()) == pytest.approx(1.0)


def test_two_pass_argmax_is_the_first_maximum():
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 50, (6, 3000), generator=g).float()  # many ties at the maximum
    x[1] = float("-inf")
    x[1, 2999] = 0.0  # the maximum in the padded tail block
    x[2, :] = 7.0  # all equal: index 0
    assert two_pass_argmax(x).tolist() == x.argmax(dim=-1).tolist()
    assert two_pass_argmax(x)[1:3].tolist() == [2999, 0]
