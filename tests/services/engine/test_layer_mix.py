"""A target whose layers alternate a 64-token window and full attention (a random Qwen2
checkpoint saved by ``transformers``: two target layer groups) served by the engine on CPU
float32 gives transformers' greedy tokens past the window: with prefill chunks shorter and
longer than the window, with and without a windowed EAGLE-3 drafter, through prefix-cache
hits, on the CUDA-graph path run eagerly, and replayed from lockstep plans; every page is
freed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.engine import lockstep
from services.engine.device.cuda_graphs import capture_decode_graphs
from services.engine.lockstep import Lockstep, replay
from services.engine.sampling.params import SamplingParams
from tests.services.engine.helpers import assert_pools_empty
from tests.services.engine.models.hf_models import layer_mix
from tests.services.engine.test_target_window import (
    GREEDY,
    continuation_and_branch,
    engine,
    prompt,
    reference,
    windowed_pair,
)

WINDOW = 64
N = -1  # NULL_PAGE
MIX = layer_mix(WINDOW)


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    """(target folder, drafter folder, the transformers model)."""
    return windowed_pair(tmp_path_factory.mktemp("mix"), "qwen2", **MIX)


@pytest.mark.parametrize("chunk", [16, 128])
@pytest.mark.parametrize("k", [0, 2])
def test_greedy_tokens_equal_transformers(mix, chunk, k):
    e = engine(mix, chunk, k)
    groups = {name: (g.layer_ids, g.window) for name, g in e.manager.groups.items()}
    assert groups["target"] == ((1, 3), 0) and groups["target_sliding"] == ((0, 2), WINDOW)
    prompts = [prompt(100, seed=1), prompt(130, seed=2)]
    outputs = e.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [reference(mix[2], p) for p in prompts]
    assert_pools_empty(e)


def test_the_sliding_group_releases_its_pages_as_the_window_moves(mix):
    e = engine(mix, 128, 2)
    rid = e.add_request(prompt(150, seed=3), GREEDY)
    while len(e.requests[rid].output_ids) < 8:
        e.step()
    n = e.requests[rid].num_computed
    full, sliding = (e.manager.block_table(rid, g) for g in ("target", "target_sliding"))
    assert len(full) == len(sliding) and N not in full
    first = (n - (WINDOW + 1) + 1) // 4  # it feeds the drafter: W + 1 positions kept
    assert sliding[:first] == [N] * first and N not in sliding[first:]
    while e.has_unfinished():
        e.step()
    assert_pools_empty(e)


@pytest.mark.parametrize("k", [0, 2])
def test_a_continuation_hits_both_target_groups_and_a_branch_before_the_window_hits_none(mix, k):
    e = engine(mix, 16, k)
    # the whole pages of the exact prefix: 100 + 23; the window at 50 reaches released pages
    outputs = continuation_and_branch(e, mix[2], 100, 120, 50)
    groups = ("target", "target_sliding", "draft") if k else ("target", "target_sliding")
    assert outputs[0].usage.cached_tokens == dict.fromkeys(groups, 120)
    assert outputs[1].usage.cached_tokens == dict.fromkeys(groups, 0)
    assert_pools_empty(e)


@pytest.mark.parametrize("k", [0, 2])
def test_the_graph_path_run_eagerly_gives_the_same_tokens(mix, k):
    """The decode step's graphs (the target's attend both groups, each with its own table
    and slots; with a drafter, the device-resident chain whose verify stage does too),
    uncaptured: the static-buffer path the captured graphs replay."""
    e = engine(mix, 128, k, device_draft_chain=True)
    e.runner.graphs = capture_decode_graphs(e.runner, k + 1, 4, e.max_model_len, capture=False)
    assert [g.name for g in e.runner.graphs.target.groups] == ["target", "target_sliding"]
    prompts = [prompt(90, seed=8), prompt(110, seed=9)]
    outputs = e.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [reference(mix[2], p) for p in prompts]
    graphs = e.runner.graphs
    assert sum(graphs.target.replays.values()) > 0
    assert (sum(graphs.chain.replays.values()) > 0) if k else graphs.chain is None
    assert_pools_empty(e)


def test_lockstep_plans_carry_every_group(mix, monkeypatch):
    """What rank 0 publishes, replayed by another engine's runner (as ranks 1.. do): the
    same KV in every pool, the sliding group's and the full group's alike."""
    leader, follower = engine(mix, 16, 2), engine(mix, 16, 2)
    plans = []
    monkeypatch.setattr(lockstep.dist, "broadcast_object_list", lambda box, **_: plans.append(box[0]))
    leader.runner.lockstep = Lockstep(SimpleNamespace(object_group=None), leader.kv_pools)
    leader.generate([prompt(80, seed=10)], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert {tuple(g.group for g in p.groups) for p in plans} == {("target", "target_sliding"), ("draft",)}
    for plan in plans:
        replay(plan, follower.runner)
    for group in ("target", "target_sliding", "draft"):
        assert torch.equal(follower.kv_pools.tensor(group), leader.kv_pools.tensor(group)), group
