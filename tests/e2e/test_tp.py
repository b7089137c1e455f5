"""Tensor-parallel workers, and transfers between prefill and decode of different TP sizes.

One cluster of real processes: a prefill worker of TP 1 and one of TP 2, a decode worker of
TP 1 and one of TP 2 (each TP 2 worker is two processes in lockstep over gloo), serving
the bundled trained pair (so acceptance means something). Requests are driven through
each (prefill, decode) pair in turn with the worker APIs, and through the router.

Tolerance: TP ranks sum partial matmuls in another order than one rank does, so float32
activations differ in their last bits from TP 1's; greedy tokens of a confident model do
not move, and neither do the accepted drafts. The longest prompt runs past the drafter's
256-token window, so only the window's draft pages travel and are re-sliced.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.local import LocalCluster
from models.byte_tokenizer import byte_ids
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from services.engine import Engine, EngineConfig, SamplingParams
from tests.e2e.conftest import assert_no_request_holds_pages, generate, run_on_pair

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MODEL, DRAFTER = ROOT / "models/tiny-target", ROOT / "models/tiny-drafter"
K = 4
MAX_TOKENS = 24
SOURCE = (ROOT / "kvcore/radix.py").read_text()
PROMPTS = [byte_ids(t) for t in ("class Stack:\n    def __init__(self):", SOURCE[:300])]
ROLES = {"prefill-0": 1, "prefill-1": 2, "decode-2": 1, "decode-3": 2}  # name -> TP size
PAIRS = [("prefill-0", "decode-3"), ("prefill-1", "decode-2"), ("prefill-1", "decode-3")]
# TP 1->2, 2->1 and 2->2 (1->1 is every other e2e test's)


@pytest.fixture(scope="module")
def reference():
    """TP 1 aggregated: one in-process engine, one request at a time."""
    engine = Engine(
        EngineConfig(
            model=str(MODEL),
            drafter=str(DRAFTER),
            num_spec_tokens=K,
            kv_cache_bytes=32 << 20,
            max_num_seqs=16,
        )
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [engine.generate([p], greedy)[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def cluster(reference):  # the reference first: idle cluster processes still take CPU
    worker = [
        "--model",
        str(MODEL),
        "--drafter",
        str(DRAFTER),
        "-k",
        str(K),
        "--kv-cache-mb",
        "32",
        "--max-num-seqs",
        "16",
        "--max-model-len",  # 32 MiB hold ~4K tokens, not the model's 32768: the workers would refuse
        "1024",
    ]
    router = ["--model", str(MODEL), "-k", str(K), "--max-model-len", "1024"]
    roles = [(name.split("-")[0], ["--tp", str(tp)]) for name, tp in ROLES.items()]
    cluster = LocalCluster(worker, router, roles, start_timeout_s=120)
    cluster.start()
    yield cluster
    cluster.stop()


def test_every_rank_registered_and_every_pair_is_ready(cluster):
    with cluster.channel() as channel:
        stub = cpb_grpc.TandemStub(channel)
        health = stub.Health(cpb.HealthRequest(), timeout=5)
        workers = stub.ModelInfo(cpb.ModelInfoRequest(), timeout=5).workers
    assert health.num_ready_pairs == 4, health.message
    assert {w.instance_id: w.tp_size for w in workers} == ROLES
    assert all(w.tp_rank == 0 for w in workers)
    heads = {
        w.instance_id: {g.name: (g.num_kv_heads, g.total_num_kv_heads) for g in w.groups} for w in workers
    }
    assert heads["decode-3"] == {"target": (1, 2), "draft": (1, 2)}
    assert heads["decode-2"] == {"target": (2, 2), "draft": (2, 2)}


@pytest.mark.parametrize("prefill,decode", PAIRS)
def test_each_tp_pair_decodes_what_tp1_aggregated_decodes(cluster, reference, prefill, decode):
    moved = []
    for prompt, ref in zip(PROMPTS, reference, strict=True):
        tokens, prefilled, decoded = run_on_pair(cluster, (prefill, decode), prompt, MAX_TOKENS)
        assert tokens == ref.token_ids, len(prompt)
        assert decoded.acceptance_length == pytest.approx(ref.usage.acceptance_length, rel=0.01)
        moved.append({t.group: t.num_bytes for t in prefilled.transfers})
    # every rank moves its heads only: the bytes are the whole pages' (of the window, for
    # the drafter), whatever the TP sizes
    page = {"target": 6 * 2 * 2 * 16 * 64 * 4, "draft": 1 * 2 * 2 * 16 * 64 * 4}
    for prompt, groups in zip(PROMPTS, moved, strict=True):
        pages = -(-len(prompt) // 16)
        assert groups["target"] == pages * page["target"]
        assert groups["draft"] == min(pages, 17) * page["draft"]
    assert_no_request_holds_pages(cluster)


def test_through_the_router_every_pair_agrees_with_tp1(cluster, reference):
    for prompt, ref in zip(PROMPTS, reference, strict=True):
        tokens, complete = generate(cluster.router_address, prompt, MAX_TOKENS, temperature=0)
        assert tokens == ref.token_ids
        assert complete.usage.acceptance_length == pytest.approx(ref.usage.acceptance_length, rel=0.01)
    assert_no_request_holds_pages(cluster)


@pytest.mark.parametrize("prefill,decode", PAIRS)
def test_a_continuation_skips_the_pages_each_decode_rank_holds(cluster, reference, prefill, decode):
    """Turn 2 extends turn 1 (prompt and answer), which the decode group cached: only the
    pages after the held prefix travel, re-sliced as before, and the tokens still agree."""
    first = PROMPTS[0] + [ord(decode[-1])]  # a turn 1 of this decode worker's own
    answer, _, _ = run_on_pair(cluster, (prefill, decode), first, MAX_TOKENS, reserve_prompt=True)
    second = first + answer + byte_ids("\n    def push(self, x):")
    tokens, prefilled, decoded = run_on_pair(
        cluster, (prefill, decode), second, MAX_TOKENS, reserve_prompt=True
    )
    engine = Engine(
        EngineConfig(
            model=str(MODEL),
            drafter=str(DRAFTER),
            num_spec_tokens=K,
            kv_cache_bytes=32 << 20,
            max_num_seqs=16,
        )
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    assert answer == engine.generate([first], greedy)[0].token_ids
    assert tokens == engine.generate([second], greedy)[0].token_ids
    pages = -(-len(second) // 16)
    page = {"target": 6 * 2 * 2 * 16 * 64 * 4, "draft": 1 * 2 * 2 * 16 * 64 * 4}
    for t in prefilled.transfers:
        assert t.num_held_pages >= len(first) // 16 > 0, t.group
        assert t.num_held_pages + t.num_pages == pages, t.group
        assert t.num_bytes == t.num_pages * page[t.group], t.group
    assert_no_request_holds_pages(cluster)
