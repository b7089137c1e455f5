"""The device-resident step (device_step.py, draft_chain.py) through its static path on the
CPU: the same drafts as the eager chain, greedy tokens equal to target-only's, sampled
tokens equal to the general path's, and the general path for every batch it does not
cover."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.engine.device.device_step import device_step_fits
from services.engine.device.draft_chain import Draw
from services.engine.models import Eagle3Drafter
from services.engine.sampling.params import SamplingParams
from services.engine.speculation.rejection import greedy_accepted, greedy_tokens, greedy_verdict
from tests.services.engine.chain_helpers import compare_chains
from tests.services.engine.device.test_cuda_graphs import GREEDY, with_static_path
from tests.services.engine.helpers import make_engine, random_prompts


@pytest.mark.parametrize("k", [2, 4])
def test_chain_drafts_equal_the_eager_chain(pair, k):
    engine = with_static_path(make_engine(pair, k=k))
    prompts = random_prompts(3, seed=30 + k, min_len=5, max_len=30)
    assert compare_chains(engine, prompts, GREEDY) > 5


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_chain_equals_target_only(pair, k):
    prompts = random_prompts(5, seed=40 + k, max_len=30)
    plain = make_engine(pair, k=0).generate(prompts, GREEDY)
    engine = with_static_path(make_engine(pair, k=k))
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [o.token_ids for o in plain]
    assert engine.runner.graphs.chain.replays[Draw.GREEDY] > 0


SAMPLED = [
    SamplingParams(temperature=0.8, max_tokens=24, seed=3, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),  # greedy in a sampled batch
    SamplingParams(temperature=1.3, min_p=0.05, max_tokens=24, seed=-9, ignore_eos=True),
]
FILTERED = [
    SamplingParams(temperature=0.9, top_k=5, max_tokens=24, seed=4, ignore_eos=True),
    SamplingParams(temperature=1.1, top_p=0.8, max_tokens=24, seed=5, ignore_eos=True),
    SamplingParams(temperature=0.7, max_tokens=24, seed=6, ignore_eos=True),
]


@pytest.mark.parametrize(("k", "params", "draw"), [(2, SAMPLED, Draw.SAMPLED), (3, FILTERED, Draw.FILTERED)])
def test_sampled_chain_equals_the_general_path(pair, k, params, draw):
    """Seeded sampled requests (and a greedy one beside them) draw the same tokens through
    the device-resident step as through the eager chain and ``verify``."""
    prompts = random_prompts(3, seed=70 + k, min_len=4, max_len=30)
    general = with_static_path(make_engine(pair, k=k, device_draft_chain=False)).generate(prompts, params)
    engine = with_static_path(make_engine(pair, k=k))
    out = engine.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in general]
    replays = engine.runner.graphs.chain.replays
    assert replays[draw] > 0
    assert engine.stats["local"].num_accepted > 0  # sampled drafts were kept, not only drawn


def test_sampled_drafts_equal_the_eager_chain(pair):
    engine = with_static_path(make_engine(pair, k=4))
    prompts = random_prompts(3, seed=81, min_len=5, max_len=30)
    assert compare_chains(engine, prompts, FILTERED[0]) > 5


def test_other_batches_take_the_general_path(pair):
    engine = with_static_path(make_engine(pair, k=2))
    sampled = SamplingParams(temperature=0.7, max_tokens=12, seed=3, ignore_eos=True)
    penalized = SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3)
    late_min = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    engine.generate([[1, 2, 3], [4, 5]], [sampled, penalized])
    engine.generate([[1, 2, 3]], late_min)
    assert not any(engine.runner.graphs.chain.replays.values())
    penalized_id, sampled_id = engine.add_request([1, 2, 3], penalized), engine.add_request([4, 5], sampled)
    engine.step()  # both prefill
    reqs = [engine.requests[sampled_id], engine.requests[penalized_id]]
    assert device_step_fits(engine.runner, reqs, 2) is None  # one penalized row: all general
    plan = device_step_fits(engine.runner, reqs[:1], 2)
    assert plan.graphs is engine.runner.graphs
    ids = [reqs[0].request_id]
    assert torch.equal(plan.target_tables[0], engine.manager.block_tables(ids, "target"))
    assert torch.equal(plan.draft_table, engine.manager.block_tables(ids, "draft"))
    assert device_step_fits(engine.runner, reqs[:1], 1) is None  # not the chain's K


def test_forced_acceptance_through_the_chain(pair):
    engine = with_static_path(make_engine(pair, k=3, forced_acceptance=2, unsafe_forced_acceptance=True))
    engine.generate(
        random_prompts(4, seed=5), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    )
    stats = engine.stats["local"]
    assert engine.runner.graphs.chain.replays[Draw.GREEDY] > 0
    assert stats.num_accepted == 2 * stats.num_steps


def test_greedy_accepted():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    best = torch.tensor([[1, 2, 3, 9], [1, 5, 3, 9], [0, 2, 3, 9]])
    assert greedy_accepted(drafts, best).tolist() == [3, 1, 0]
    assert greedy_accepted(drafts, best, forced=2).tolist() == [2, 2, 2]
    assert greedy_accepted(drafts, best, forced=7).tolist() == [3, 3, 3]
    assert greedy_accepted(drafts, best, torch.tensor([-1])).tolist() == [3, 1, 0]
    assert greedy_accepted(drafts, best, torch.tensor([2])).tolist() == [2, 2, 2]
    assert greedy_accepted(drafts, best, torch.tensor([9])).tolist() == [3, 3, 3]


def test_greedy_verdict_rows_give_the_emitted_tokens():
    ids = torch.tensor([[10, 1, 2, 3], [11, 4, 5, 6], [12, 7, 8, 9]])  # [t_n, d_1..d_3]
    best = torch.tensor([[1, 2, 3, 40], [4, 50, 6, 60], [70, 8, 9, 80]])
    rows = greedy_verdict(ids, best)
    assert rows.shape == (12, 3)
    assert rows[:4].tolist() == [[10, 1, 3], [1, 2, 3], [2, 3, 3], [3, 40, 3]]
    assert greedy_tokens(rows.tolist(), 4) == [[1, 2, 3, 40], [4, 50], [70]]
    forced = greedy_verdict(ids, best, torch.tensor([1]))
    assert greedy_tokens(forced.tolist(), 4) == [[1, 2], [4, 50], [7, 8]]
    plain = greedy_verdict(ids[:, :1], best[:, :1])  # a step without drafts
    assert greedy_tokens(plain.tolist(), 1) == [[1], [4], [70]]


def test_greedy_head_over_a_reduced_vocabulary_is_the_full_argmax(pair):
    """With a draft vocabulary smaller than the target's (EAGLE-3's d2t), the chain's greedy
    head takes the argmax over the drafter's own logits and maps it: the same ids as the
    argmax of the full-vocabulary logits, ties (first maximum) included. A map that is not
    increasing gets no such head."""
    engine = make_engine(pair, k=2)
    runner, drafter = engine.runner, engine.runner.drafter
    c = drafter.config
    reduced = Eagle3Drafter(replace(c, draft_vocab_size=c.vocab_size // 2))
    reduced.load_state_dict(
        {k: v for k, v in drafter.state_dict().items() if not k.startswith("lm_head")}, strict=False
    )
    kept = torch.randperm(c.vocab_size, generator=torch.Generator().manual_seed(0))[: c.vocab_size // 2]
    reduced.d2t.copy_(kept.sort().values - torch.arange(c.vocab_size // 2))
    runner.drafter = reduced
    g = torch.randn(6, c.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reduced.lm_head.weight[1] = reduced.lm_head.weight[0]  # draft ids 0 and 1 tie on every row
        g[5] = 0
        greedy = runner.draft_greedy()
        assert torch.equal(greedy(g), runner.draft_logits(g).argmax(dim=-1))
        reduced.d2t[:2] = torch.stack([kept.sort().values[1], kept.sort().values[0]]) - torch.arange(2)
        assert runner.draft_greedy() is None
