"""On the GPU: the graphed draft chain gives the eager chain's drafts token for token at
K = 2, 4, 6 over batch sizes 1, 3 and 6 (buckets 1, 4, 8), greedy and sampled (an fp8
drafter's at one request); greedy speculation through it gives target-only's tokens (with
an fp8 drafter too), and sampled speculation through it gives the general path's."""

from __future__ import annotations

import pytest
import torch

from services.engine.device.draft_chain import Draw
from services.engine.sampling.params import SamplingParams
from tests.services.engine.chain_helpers import compare_chains
from tests.services.engine.device.test_cuda_graphs_gpu import GREEDY, PROMPTS, tiny_engine, tokens
from tests.services.engine.helpers import make_engine, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("k", [2, 4, 6])
def test_graphed_chain_equals_eager_chain(k):
    engine = tiny_engine(k, "bfloat16", enforce_eager=False)
    assert sorted({bucket for _, bucket, _ in engine.runner.graphs.chain.graphs}) == [1, 2, 4, 8]
    for count in (1, 3, 6):
        assert compare_chains(engine, PROMPTS[:count], GREEDY, steps=30) > 10
    assert engine.runner.graphs.chain.replays[Draw.GREEDY] > 0


@pytest.mark.parametrize("k", [2, 4, 6])
def test_greedy_speculation_through_the_chain_equals_target_only(k):
    plain = tokens(tiny_engine(0, "bfloat16", enforce_eager=False), PROMPTS)
    engine = tiny_engine(k, "bfloat16", enforce_eager=False)
    assert tokens(engine, PROMPTS) == plain
    assert engine.runner.graphs.chain.replays[Draw.GREEDY] > 0


@pytest.mark.parametrize("k,count", [(2, 3), (3, 8)])
def test_random_pair_chain_equals_eager_chain(pair, k, count):
    options = dict(device="cuda", dtype="bfloat16", max_num_seqs=8)
    engine = make_engine(pair, k=k, **options)
    prompts = random_prompts(count, seed=51 + count, min_len=5, max_len=40)
    assert compare_chains(engine, prompts, GREEDY, steps=30) > 5


SAMPLED = [
    SamplingParams(temperature=0.8, max_tokens=48, seed=i, ignore_eos=True, **extra)
    for i, extra in enumerate([{}, {"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.05}, {}, {}])
]


@pytest.mark.parametrize("k", [2, 4])
def test_sampled_chain_equals_eager_chain(k):
    engine = tiny_engine(k, "bfloat16", enforce_eager=False)
    for count in (1, 3, 6):
        assert compare_chains(engine, PROMPTS[:count], SAMPLED[count - 1], steps=30) > 10
    replays = engine.runner.graphs.chain.replays
    assert replays[Draw.SAMPLED] > 0 and replays[Draw.FILTERED] > 0


@pytest.mark.parametrize("k", [2, 4])
def test_sampled_speculation_through_the_chain_equals_the_general_path(k):
    general = tiny_engine(k, "bfloat16", enforce_eager=False, device_draft_chain=False)
    engine = tiny_engine(k, "bfloat16", enforce_eager=False)
    assert tokens(engine, PROMPTS, SAMPLED) == tokens(general, PROMPTS, SAMPLED)
    assert engine.runner.graphs.chain.replays[Draw.FILTERED] > 0


@pytest.mark.parametrize("count", [1, 6])
def test_fp8_drafter_graphed_chain_equals_eager_chain(count):
    """With an fp8 drafter a matmul of more than FP8_ROWS rows reads the dense weight. The
    chain's catch-up stage runs K + 1 rows per request where a separate catch-up of a
    one-token span runs one, so the two round differently: the stage is left out here (its
    bf16 form is compared above), and the graphed chain after the same catch-up as the
    eager one must draft the same."""
    engine = tiny_engine(2, "bfloat16", enforce_eager=False, draft_quantization="fp8")
    assert compare_chains(engine, PROMPTS[:count], GREEDY, steps=30, stage=False) > 10


@pytest.mark.parametrize("k", [2, 4])
def test_fp8_drafter_speculation_equals_target_only(k):
    plain = tokens(tiny_engine(0, "bfloat16", enforce_eager=False), PROMPTS)
    engine = tiny_engine(k, "bfloat16", enforce_eager=False, draft_quantization="fp8")
    assert tokens(engine, PROMPTS) == plain
    assert engine.runner.graphs.chain.replays[Draw.GREEDY] > 0
