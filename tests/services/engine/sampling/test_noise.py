"""Counter-based draws: a pure function of (seed, position, lane), uniform, and what the
sampler draws with them follows the row's distribution."""

from __future__ import annotations

import torch

from services.engine.sampling.noise import ACCEPT, DRAFT, TARGET, request_seed, uniforms
from services.engine.sampling.sampler import sample

CHI2_DF9_P001 = 27.877  # chi-square critical value, 9 degrees of freedom, p = 0.001
CHI2_DF7_P001 = 24.322


def test_draws_depend_on_seed_position_and_lane_only():
    seeds = torch.tensor([5, 5, 6, 2**62 + 5])
    positions = torch.tensor([10, 11, 10, 10])
    u = uniforms(seeds, positions, TARGET)
    assert u.tolist() == uniforms(seeds, positions, TARGET).tolist()
    assert len(set(u.tolist())) == 4  # every key moves the draw, the seed's high word too
    assert uniforms(seeds[:1], positions[:1], TARGET).tolist() == u[:1].tolist()  # not the batch
    lanes = [float(uniforms(seeds[:1], positions[:1], lane)) for lane in (DRAFT, ACCEPT, TARGET)]
    assert len(set(lanes)) == 3
    grid = uniforms(seeds, positions[:, None] + torch.arange(3), ACCEPT)  # [rows, 3]
    assert grid[:, 0].tolist() == uniforms(seeds, positions, ACCEPT).tolist()


def test_draws_are_uniform_and_in_the_unit_interval():
    n = 200_000
    u = uniforms(torch.full((n,), 123), torch.arange(n), TARGET)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    expected = n / 10
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_DF9_P001
    pairs = u.view(-1, 2)  # successive positions are not correlated
    assert abs(float(torch.corrcoef(pairs.T)[0, 1])) < 0.01


def test_sample_follows_the_distribution_and_never_draws_probability_zero():
    probs = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.1, 0.2, 0.05, 0.1, 0.05])
    n = 50_000
    tokens = sample(probs.expand(n, 10), torch.arange(n), torch.full((n,), 9), TARGET)
    counts = torch.bincount(tokens, minlength=10).float()
    assert counts[1] == 0 and counts[4] == 0
    kept = probs > 0
    expected = probs[kept] * n
    assert float(((counts[kept] - expected) ** 2 / expected).sum()) < CHI2_DF7_P001  # 8 kept


def test_request_seed_keeps_64_bits_as_int64():
    assert request_seed(7) == 7
    assert request_seed(2**64 - 1) == request_seed(-1) == -1
    assert request_seed(2**63) == -(2**63)
    assert request_seed(2**70 + 3) == 3
    seeds = torch.tensor([request_seed(5), request_seed(5 + 2**63), request_seed(5 + 2**32)])
    assert len(set(uniforms(seeds, torch.zeros(3, dtype=torch.long), TARGET).tolist())) == 3
