"""On the GPU: decode steps replayed from CUDA graphs give the eager engine's tokens, token
for token (greedy), for the bundled tiny pair and the random pair."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.device.draft_chain import Draw
from services.engine.engine import Engine
from services.engine.sampling.params import SamplingParams
from tests.services.engine.helpers import make_engine, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TINY = Path(__file__).resolve().parents[4] / "models"
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
PROMPTS = [
    "def fib(n):",
    "import os\nimport sys\n",
    "class Queue:\n    def __init__(self",
    "    for i in range(len(",
    "# Copyright",
    "if __name__ == '__main__':\n",
]


def tiny_engine(k: int, dtype: str, enforce_eager: bool, **overrides) -> Engine:
    return Engine(
        EngineConfig(
            model=str(TINY / "tiny-target"),
            drafter=str(TINY / "tiny-drafter") if k else None,
            num_spec_tokens=k,
            device="cuda",
            dtype=dtype,
            max_num_seqs=8,
            enforce_eager=enforce_eager,
            **overrides,
        )
    )


def tokens(engine: Engine, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("dtype,count", [("bfloat16", 4), ("bfloat16", 1), ("float32", 3), ("bfloat16", 6)])
@pytest.mark.parametrize("k", [0, 4])
def test_tiny_pair_graphs_equal_eager(k, dtype, count):
    prompts = PROMPTS[:count]
    graphed = tiny_engine(k, dtype, enforce_eager=False)
    assert graphed.runner.graphs is not None
    assert sorted(graphed.runner.graphs.target.graphs) == [1, 2, 4, 8]
    assert tokens(graphed, prompts) == tokens(tiny_engine(k, dtype, enforce_eager=True), prompts)
    assert sum(graphed.runner.graphs.target.replays.values()) > 0
    if k:  # the graphed greedy chain too, with the drafter's catch-ups in its graph
        assert graphed.runner.graphs.chain.replays[Draw.GREEDY] > 0
        assert graphed.runner.graphs.chain.caught_up > 0


@pytest.mark.parametrize("k,count", [(0, 3), (2, 3), (2, 8), (3, 5)])
def test_random_pair_graphs_equal_eager(pair, k, count):
    prompts = random_prompts(count, seed=21 + count, max_len=40)
    options = dict(device="cuda", dtype="bfloat16", max_num_seqs=8)
    graphed = make_engine(pair, k=k, **options)
    eager = make_engine(pair, k=k, enforce_eager=True, **options)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    assert [o.token_ids for o in graphed.generate(prompts, greedy)] == [
        o.token_ids for o in eager.generate(prompts, greedy)
    ]
    assert sum(graphed.runner.graphs.target.replays.values()) > 0


SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=48, seed=3)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
@pytest.mark.parametrize("k", [0, 4])
def test_overlapped_steps_equal_synchronous_ones(k, params):
    """Each decode step launched before the previous one is read (overlapped_steps.py):
    the same tokens and, drafting, the same acceptance as the synchronous graphed engine,
    prompts joining mid-run included."""
    runs = {}
    for overlap in (False, True):
        engine = tiny_engine(k, "bfloat16", enforce_eager=False, overlap=overlap, adaptive_k=False)
        ids = [engine.add_request(p, params) for p in PROMPTS[:3]]
        final, steps = {}, 0
        while engine.has_unfinished() or len(ids) < len(PROMPTS):
            if steps >= 5 and len(ids) < len(PROMPTS):
                ids.append(engine.add_request(PROMPTS[len(ids)], params))
            final.update({o.request_id: o for o in engine.step() if o.finished})
            steps += 1
        runs[overlap] = [(final[i].token_ids, final[i].usage.num_accepted) for i in ids]
    assert runs[True] == runs[False]
