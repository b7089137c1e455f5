"""The decode step's graph path, run without a capture on the CPU: bucket padding, static
inputs and fallbacks. The same code captured and replayed is checked by
test_cuda_graphs_gpu.py."""

from __future__ import annotations

import pytest
import torch

from kvcore.spec import NULL_PAGE
from services.engine import engine as engine_module
from services.engine.batch import Span
from services.engine.device.cuda_graphs import (
    GraphedForward,
    PagedGroup,
    UniformBatch,
    batch_buckets,
    capture_decode_graphs,
    pad_front,
)
from services.engine.device.device_step import device_step
from services.engine.device.draft_chain import Draw
from services.engine.sampling.params import SamplingParams
from services.engine.warm_up import warm_up
from tests.services.engine.helpers import make_engine, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def with_static_path(engine, max_batch: int = 8):
    """The engine's runner routed through the graph path, uncaptured (CPU)."""
    engine.runner.graphs = capture_decode_graphs(
        engine.runner, engine.k + 1, max_batch, engine.max_model_len, capture=False
    )
    return engine


def test_batch_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(12) == (1, 2, 4, 8, 16)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(5000)[-1] == 512
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)


@pytest.mark.parametrize(("k", "chain"), [(0, False), (0, True), (1, True), (3, True), (3, False)])
@pytest.mark.parametrize("count", [3, 8])
def test_static_path_equals_eager(pair, k, chain, count, monkeypatch):
    """``chain``: greedy steps take the device-resident step (device_step.py; with K = 0
    the target alone), else the general path (the eager chain over the one-token drafter
    graph)."""
    prompts = random_prompts(count, seed=11 + count, max_len=30)
    eager = make_engine(pair, k=k)
    graphed = with_static_path(make_engine(pair, k=k, device_draft_chain=chain))
    steps = []
    monkeypatch.setattr(engine_module, "device_step", lambda *a: steps.append(1) or device_step(*a))
    assert [o.token_ids for o in graphed.generate(prompts, GREEDY)] == [
        o.token_ids for o in eager.generate(prompts, GREEDY)
    ]
    graphs = graphed.runner.graphs
    assert sum(graphs.target.replays.values()) > 0  # verify forwards took the graph path
    assert max(graphs.target.replays) == (4 if count == 3 else 8)  # 3 requests pad to 4
    assert bool(steps) == chain
    if k and chain:
        assert graphs.chain.replays[Draw.GREEDY] > 0  # (one-token catch-ups still replay the drafter graph)
    elif k > 1:
        assert sum(graphs.drafter.replays.values()) > 0 and not any(graphs.chain.replays.values())


def test_sampled_outputs_equal_eager(pair):
    sampling = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=5)
    prompts = random_prompts(4, seed=3)
    eager = make_engine(pair, k=2).generate(prompts, sampling)
    graphed = with_static_path(make_engine(pair, k=2)).generate(prompts, sampling)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


def test_batches_past_the_largest_bucket_and_mixed_spans_run_eagerly(pair):
    engine = with_static_path(make_engine(pair, k=2), max_batch=2)
    prompts = random_prompts(5, seed=4)
    reference = make_engine(pair, k=2).generate(prompts, GREEDY)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [o.token_ids for o in reference]
    graphs = engine.runner.graphs
    assert set(graphs.target.replays) <= {1, 2}
    assert graphs.run_target([Span("x", 0, [1, 2]), Span("y", 0, [1])]) is None  # uneven
    assert graphs.run_target([Span(str(i), 0, [1, 2, 3]) for i in range(3)]) is None  # > 2


def test_load_pads_rows_and_slots():
    """Padding rows read nothing (seq_len 0) and write nothing (slot -1); real rows' table
    tails are NULL, whatever an earlier, wider batch left there."""
    pool = torch.zeros(8, 1, 2, 1, 4, 2)
    graphed = GraphedForward(
        lambda *a: (), [PagedGroup("target", (0,), pool)], q_len=2, buckets=(1, 4), max_pages=3, capture=False
    )
    wide = UniformBatch(
        torch.arange(8),
        torch.arange(8),
        (torch.arange(8),),
        (torch.ones(4, 3, dtype=torch.int32),),
        torch.full((4,), 9, dtype=torch.int32),
    )
    assert graphed.load(wide) == 4
    narrow = UniformBatch(
        torch.tensor([5, 6, 7, 8]),
        torch.tensor([3, 4, 0, 1]),
        (torch.tensor([13, -1, 0, 1]),),
        (torch.tensor([[3], [0]], dtype=torch.int32),),
        torch.tensor([5, 2], dtype=torch.int32),
    )
    assert graphed.load(narrow) == 4
    t = graphed.max_tokens
    assert graphed.dev_i64[:4].tolist() == [5, 6, 7, 8]
    assert graphed.dev_i64[t : t + 4].tolist() == [3, 4, 0, 1]
    assert graphed.dev_i64[2 * t : 2 * t + 8].tolist() == [13, -1, 0, 1, -1, -1, -1, -1]
    assert graphed.dev_i32[:4].tolist() == [5, 2, 0, 0]
    table = graphed._table(graphed.dev_i32, 4)
    assert table[:2].tolist() == [[3, NULL_PAGE, NULL_PAGE], [0, NULL_PAGE, NULL_PAGE]]
    with pytest.raises(ValueError, match="batch"):
        graphed.load(
            UniformBatch(
                *(torch.zeros(10, dtype=torch.int64),) * 2,
                (torch.zeros(10, dtype=torch.int64),),
                (torch.zeros(5, 1, dtype=torch.int32),),
                torch.zeros(5, dtype=torch.int32),
            )
        )


def test_pad_front_keeps_real_rows_and_writes():
    spans = [
        Span("a", 7, [1, 2], write_start=0),
        Span("b", 3, [4, 5, 6, 7]),
        Span("c", 9, [8], write_start=10),
    ]
    padded, rows = pad_front(spans, 4)
    assert [(s.start, s.token_ids, s.write_start) for s in padded] == [
        (5, [0, 0, 1, 2], 7),
        (3, [4, 5, 6, 7], 3),
        (6, [0, 0, 0, 8], 10),
    ]
    assert rows.tolist() == [2, 3, 4, 5, 6, 7, 11]
    assert pad_front([Span("a", 1, [1, 2])], 4) is None  # would start before position 0
    assert pad_front([Span("a", 9, [1] * 5)], 4) is None  # longer than the graph


def test_catch_up_takes_the_padded_graph(pair):
    engine = with_static_path(make_engine(pair, k=3, device_draft_chain=False))
    prompts = random_prompts(3, seed=8, min_len=10, max_len=30)
    reference = make_engine(pair, k=3).generate(prompts, GREEDY)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [o.token_ids for o in reference]
    assert sum(engine.runner.graphs.catch_up.replays.values()) > 0


def test_device_step_catches_up_in_the_chain(pair):
    engine = with_static_path(make_engine(pair, k=3))
    prompts = random_prompts(3, seed=8, min_len=10, max_len=30)
    reference = make_engine(pair, k=0).generate(prompts, GREEDY)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [o.token_ids for o in reference]
    graphs = engine.runner.graphs
    assert graphs.chain.caught_up == sum(graphs.chain.replays.values()) > 0
    assert not graphs.catch_up.replays  # every pending span fit the chain's stage


def test_the_warm_up_replays_the_graphs_and_leaves_their_counters_at_zero(pair, monkeypatch):
    engine = with_static_path(make_engine(pair, k=3, scheduling_policy="mixed"))
    graphs, seen = engine.runner.graphs, []
    real_forget = engine.forget_warm_up

    def forget():
        seen.append(sum(graphs.chain.replays.values()) + sum(graphs.target.replays.values()))
        real_forget()

    monkeypatch.setattr(engine, "forget_warm_up", forget)
    warm_up(engine)
    assert seen[0] > 0  # the warm-up's decode steps ran the graphs' path
    assert graphs.chain.caught_up == 0 and not any(graphs.chain.replays.values())
    for graphed in (graphs.target, graphs.plain, graphs.catch_up, graphs.lagged, graphs.drafter):
        assert graphed is None or not graphed.replays
