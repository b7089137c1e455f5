"""Forced acceptance: a benchmark switch that keeps exactly N drafts per step, refused
unless its unsafe flag is given; serving reaches it only through --unsafe-forced-acceptance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deploy.engine_config import engine_config
from deploy.options import EngineOptions
from services.engine.cli import build_parser
from services.engine.config import EngineConfig
from services.engine.sampling.params import SamplingParams
from services.engine.speculation.rejection import Draws, forced_verdict
from tests.services.engine.helpers import GREEDY, make_engine


@pytest.mark.parametrize(("k", "n"), [(4, 0), (4, 2), (4, 4), (2, 3)])
def test_every_step_accepts_exactly_n(pair, k, n):
    engine = make_engine(pair, k=k, forced_acceptance=n, unsafe_forced_acceptance=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.generate([[1, 2, 3, 4, 5], [7, 8]], params)
    stats = engine.stats["local"]
    kept = min(n, k)
    assert stats.num_steps > 0
    assert stats.num_accepted == kept * stats.num_steps  # every step, every request
    assert stats.acceptance_length == kept + 1


def test_sampled_rows_accept_exactly_n_too(pair):
    engine = make_engine(pair, k=3, forced_acceptance=2, unsafe_forced_acceptance=True)
    params = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=1)
    engine.generate([[3, 1, 4, 1, 5]], params)
    stats = engine.stats["local"]
    assert stats.num_accepted == 2 * stats.num_steps


def test_forced_verdict_keeps_n_and_takes_the_next_from_p():
    p = torch.zeros(2, 4, 6)
    p[:, :, 5] = 1.0  # the target always says 5
    q = torch.full((2, 3, 6), 1 / 6)
    drafts = torch.tensor([[1, 2, 3], [4, 4, 4]])
    v = forced_verdict(
        p, drafts, Draws(torch.zeros(2, dtype=torch.long), torch.tensor([9, 4])), 2, torch.tensor([3, 1])
    )
    assert v.num_accepted.tolist() == [2, 1] and v.next_tokens.tolist() == [5, 5]
    assert q.shape == (2, 3, 6)  # q plays no part


def test_refused_without_its_unsafe_flag():
    with pytest.raises(ValueError, match=r"forced_acceptance: .*not lossless.*unsafe_forced_acceptance"):
        EngineConfig(model="m", forced_acceptance=2)
    with pytest.raises(ValueError, match="forced_acceptance: must be >= 0"):
        EngineConfig(model="m", forced_acceptance=-2, unsafe_forced_acceptance=True)
    assert EngineConfig(model="m").forced_acceptance == -1  # off by default


def test_serving_turns_it_on_only_by_its_unsafe_option():
    names = {f.name for f in dataclasses.fields(EngineOptions)}
    assert [n for n in names if "forced" in n or "accept" in n] == ["unsafe_forced_acceptance"]
    config = engine_config(EngineOptions())
    assert config.forced_acceptance == -1 and not config.unsafe_forced_acceptance
    forced = engine_config(EngineOptions(unsafe_forced_acceptance=0))
    assert forced.forced_acceptance == 0 and forced.unsafe_forced_acceptance


def test_cli_flag_says_it_is_not_lossless():
    gen = build_parser()._subparsers._group_actions[0].choices["generate"]
    (flag,) = [a for a in gen._actions if "--unsafe-forced-acceptance" in a.option_strings]
    assert "NOT lossless" in flag.help and flag.default == -1


def test_greedy_engine_without_it_is_unchanged(pair):
    plain = make_engine(pair, k=0).generate([[1, 2, 3]], GREEDY)[0].token_ids
    spec = make_engine(pair, k=3).generate([[1, 2, 3]], GREEDY)[0].token_ids
    assert plain == spec
