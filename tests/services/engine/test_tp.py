"""Tensor parallelism inside one worker: a TP2 engine (two gloo processes in lockstep)
decodes what the TP1 engine decodes, token for token, with the same acceptance.

Tolerance: the ranks sum partial products of o and down in another order than one rank's
matmul does, so hidden states differ from TP1's in the last float32 bits. The random pair
of ``helpers`` is "peaked" (logits far apart) and the bundled trained pair is confident on
code, so greedy argmaxes, and with them every token and every accepted draft, are equal.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path

import pytest
import torch

from kvcore import DRAFT_GROUP, NULL_PAGE, KVLayout
from services.engine import Engine, EngineConfig
from services.engine.models import Eagle3Drafter, LlamaForCausalLM
from services.engine.parallel import TensorParallel, shard_state_dict
from services.engine.sampling.params import SamplingParams
from tests.services.engine.helpers import GREEDY, drafter_config, random_prompts, target_config

ROOT = Path(__file__).resolve().parents[3]
BUNDLED = dict(
    model=str(ROOT / "models/tiny-target"),
    drafter=str(ROOT / "models/tiny-drafter"),
    num_spec_tokens=4,
    kv_cache_bytes=64 << 20,
    max_num_seqs=8,
)
CODE = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):\n    print(",
    "    return self._data[key]",
]
PROMPTS = random_prompts(6, seed=11, min_len=3, max_len=40)
# second turn: prefixes of the first prompts ending inside a page (4 tokens), so prefix hits
# copy a partial page on write; the other rank must copy its own heads of it too
FOLLOW_UPS = [p[: len(p) // 4 * 4 - 2] + [5, 6, 7] for p in PROMPTS if len(p) >= 10]
TIMEOUT_S = 120


def random_pair_config(pair) -> dict:
    return dict(
        model=str(pair[0]),
        drafter=str(pair[1]),
        num_spec_tokens=3,
        tokens_per_page=4,
        num_pages=(256, 256),
        max_num_batched_tokens=64,
        max_prefill_chunk=16,
        max_num_seqs=16,
    )


def run(engine: Engine, turns: list[list], sampling: SamplingParams) -> dict:
    """Each turn's prompts to completion, one turn after the other."""
    outs = [o for prompts in turns for o in engine.generate(prompts, sampling)]
    return {
        "tokens": [o.token_ids for o in outs],
        "al": [o.usage.acceptance_length for o in outs],
        "held": {g: u.used - u.cached for g, u in engine.manager.usage().items()},
        "hit_tokens": engine.cache_stats().prefix["target"].hit_tokens,
    }


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _rank(rank: int, address: str, config: dict, turns, sampling, conn) -> None:
    from services.engine.lockstep import follow
    from services.engine.parallel import init_tensor_parallel

    torch.set_num_threads(1)
    tp = init_tensor_parallel(2, rank, address, "gloo")
    engine = Engine(EngineConfig(**config, tp_size=2))
    if rank > 0:
        follow(engine.runner, tp)
    else:
        conn.send(run(engine, turns, sampling))


def run_tp2(config: dict, turns: list[list], sampling: SamplingParams = GREEDY) -> dict:
    ctx = mp.get_context("spawn")
    address = free_address()
    parent, child = ctx.Pipe()
    procs = [
        ctx.Process(target=_rank, args=(r, address, config, turns, sampling, child), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        if not parent.poll(TIMEOUT_S):
            raise TimeoutError("rank 0 did not answer")
        return parent.recv()
    finally:
        for p in procs:
            p.kill()
            p.join()


def test_tp2_decodes_the_random_pair_as_tp1_through_windows_and_prefix_hits(pair):
    config = random_pair_config(pair)
    turns = [PROMPTS, FOLLOW_UPS]
    reference = run(Engine(EngineConfig(**config)), turns, GREEDY)
    got = run_tp2(config, turns)
    assert len(FOLLOW_UPS) >= 3 and got["hit_tokens"] == reference["hit_tokens"] > 0
    assert got["tokens"] == reference["tokens"]
    assert got["al"] == pytest.approx(reference["al"])
    assert got["held"] == {"target": 0, "draft": 0}


def test_tp2_decodes_the_bundled_pair_as_tp1_with_the_same_acceptance():
    sampling = SamplingParams(temperature=0.0, max_tokens=48)
    reference = run(Engine(EngineConfig(**BUNDLED)), [CODE], sampling)
    got = run_tp2(BUNDLED, [CODE], sampling)
    assert got["tokens"] == reference["tokens"]
    assert got["al"] == pytest.approx(reference["al"], rel=0.01)
    assert sum(got["al"]) / len(got["al"]) > 2


def test_tp2_runs_an_fp8_drafter_losslessly():
    """Each rank quantizes its own shards (a row-parallel share has its own row scales);
    the partial products are summed as in bf16."""
    sampling = SamplingParams(temperature=0.0, max_tokens=48)
    reference = run(Engine(EngineConfig(**BUNDLED)), [CODE], sampling)
    got = run_tp2({**BUNDLED, "draft_quantization": "fp8"}, [CODE], sampling)
    assert got["tokens"] == reference["tokens"]
    assert sum(got["al"]) / len(got["al"]) > 2
    assert got["held"] == {"target": 0, "draft": 0}


def _rank_blanking(rank: int, address: str, config: dict, conn) -> None:
    """Both ranks' draft pools start dirty; rank 0 reserves pages for a transfer (SEPARATE
    layout: its draft pages are zeroed) and then runs a request; rank 1 reports which draft
    pages hold zeros after replaying the first forward it is sent."""
    from services.engine.lockstep import follow, receive_plan, replay
    from services.engine.parallel import init_tensor_parallel

    torch.set_num_threads(1)
    tp = init_tensor_parallel(2, rank, address, "gloo")
    engine = Engine(EngineConfig(**config, tp_size=2))
    draft = engine.kv_pools.tensor(DRAFT_GROUP)
    draft.fill_(1.0)
    if rank == 0:
        res = engine.reserve("r", 10)
        engine.generate([[1, 2, 3]], GREEDY)
        conn.send(("rank0", [p for p in res.block_tables[DRAFT_GROUP] if p != NULL_PAGE]))
        return
    replay(receive_plan(tp), engine.runner)
    zeroed = [p for p in range(draft.shape[0]) if not torch.any(draft[p])]
    conn.send(("rank1", zeroed))
    follow(engine.runner, tp)


def test_tp2_other_ranks_blank_the_separate_layouts_reserved_draft_pages(pair):
    config = dict(random_pair_config(pair), layout=KVLayout.SEPARATE)
    ctx = mp.get_context("spawn")
    address = free_address()
    parent, child = ctx.Pipe()
    procs = [
        ctx.Process(target=_rank_blanking, args=(r, address, config, child), daemon=True) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        got = {}
        while len(got) < 2:
            if not parent.poll(TIMEOUT_S):
                raise TimeoutError("a rank did not answer")
            who, pages = parent.recv()
            got[who] = pages
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert got["rank0"] and got["rank1"] == got["rank0"]


def test_shards_of_every_rank_rebuild_the_checkpoint():
    state = LlamaForCausalLM(target_config()).state_dict()
    shards = [
        shard_state_dict(LlamaForCausalLM(target_config(), TensorParallel(2, r)), state) for r in range(2)
    ]
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    down = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(torch.cat([s[q] for s in shards]), state[q])
    assert torch.equal(torch.cat([s[o] for s in shards], dim=1), state[o])
    assert torch.equal(torch.cat([s[down] for s in shards], dim=1), state[down])
    assert torch.equal(shards[1]["lm_head.weight"], state["lm_head.weight"])


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    """2 KV heads over 4 ranks: ranks 0, 1 hold head 0 and ranks 2, 3 head 1, the head
    their query heads read."""
    state = Eagle3Drafter(drafter_config()).state_dict()
    k = "midlayer.self_attn.k_proj.weight"
    head_dim = drafter_config().head_dim
    for rank, head in enumerate([0, 0, 1, 1]):
        shard = shard_state_dict(Eagle3Drafter(drafter_config(), tp=TensorParallel(4, rank)), state)
        assert torch.equal(shard[k], state[k][head * head_dim : (head + 1) * head_dim])


def test_heads_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="num_attention_heads"):
        LlamaForCausalLM(target_config(), TensorParallel(3, 0))


@pytest.mark.parametrize("layout", ["dynamic", "block"])
def test_tp2_serves_an_fp8_checkpoint_losslessly(tmp_path, layout):
    """An FP8 folder (FP8-Dynamic, or 128 x 128 block scales) sharded over two ranks: each
    rank keeps its rows' scales (and its K range's blocks); with the drafter, its greedy
    output is TP2's own target-only output, token for token, and every page comes back."""
    from tests.services.engine.models.fp8_folders import write_fp8  # noqa: PLC0415 (test-only helper)

    folder = tmp_path / "target"
    write_fp8(Path(BUNDLED["model"]), folder, layout)
    sampling = SamplingParams(temperature=0.0, max_tokens=24)
    fp8 = {**BUNDLED, "model": str(folder)}
    plain = run_tp2({**fp8, "drafter": None, "num_spec_tokens": 0}, [CODE[:3]], sampling)
    spec = run_tp2(fp8, [CODE[:3]], sampling)
    assert spec["tokens"] == plain["tokens"]
    assert sum(spec["al"]) / len(spec["al"]) > 1.5
    assert spec["held"] == {"target": 0, "draft": 0} and set(plain["held"].values()) == {0}
