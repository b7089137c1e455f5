"""The host tier on CUDA: pinned host pages, non-blocking copies, bit-exact round trips."""

from __future__ import annotations

import pytest
import torch

from kvcore import KVCacheManager, KVPools
from tests.kvcore.conftest import N, assert_empty, make_config, pool, store

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def bits(manager: KVCacheManager, request_id: str, group: str) -> list[bytes]:
    return [
        pool(manager, group)[p].view(torch.uint8).cpu().numpy().tobytes() if p != N else b""
        for p in manager.block_table(request_id, group)[:6]
    ]


@pytest.mark.parametrize("policy", ["evict", "through"])
def test_evicted_pages_come_back_bit_identical_on_cuda(policy):
    config = make_config(
        window=16, target_pages=8, draft_pages=8, host_pages=16, host_write=policy, draft_dtype="bfloat16"
    )
    pools = KVPools.allocate(config, "cuda")
    m = KVCacheManager(config, pools)
    assert all(p.is_pinned() for p in store(m).host.host_pools.values())
    a = list(range(100, 124))
    m.allocate("a", 24, m.match_prefix(a))
    g = torch.Generator(device="cuda").manual_seed(3)
    for tensor in pools.tensors().values():
        raw = tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda", generator=g))
    m.advance("a", 24)
    before = {group: bits(m, "a", group) for group in m.groups}
    m.free("a", a)
    m.allocate("b", 26)  # evicts a's node to the host tier
    pool(m, "target").zero_()
    pool(m, "draft").zero_()  # a device page left unwritten by the recall would show
    m.free("b")
    match = m.match_prefix(a + [7])
    assert match.compute_start == {"target": 24, "draft": 24}
    m.allocate("c", 25, match)
    after = {group: bits(m, "c", group) for group in m.groups}
    assert after["target"] == before["target"]
    assert after["draft"][2:] == before["draft"][2:]
    m.free("c")
    assert_empty(m)
