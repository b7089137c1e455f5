"""The two processes of tests/kvcore/transfer/test_capped_pages.py (and its GPU twin):
a sender and a receiver move one request's pages under a message cap small enough to
split every group into several messages.

Cases, one after the other over one UCX pair (unified layout: target and draft groups):

- ``pages``: the agent's whole pages with the receiver's rows: runs pool to pool;
- ``packed``: the agent's whole pages without them: packed on the sender;
- ``sliced``: one rank pair's head slice (sender heads [1, 2) of the target, the draft's
  one head) through RankTransfer jobs: packed, then unpacked into the receiver's head 0.

Each side reports plain bytes and lists (tensors through a pipe would travel as file
descriptors): the pages' ids and bits, every page message it sent, and the pools' use
once the request is freed.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os

import torch

from kvcore import AuxState, CacheConfig, KVCacheManager, KVPools
from kvcore.transfer import HeadRoute, PeerRank, RankTransfer, RecvJob, SendJob, TransferAgent
from kvcore.transfer.tags import ACK_GROUP, message_tag, request_tag, split_tag
from kvcore.transfer.ucx import LOOPBACK_ENV, UcxTransport
from tests.kvcore.conftest import make_config
from tests.kvcore.transfer.sessions import seeded

CAP = 1024  # bytes: 2 whole target pages (512 B), 4 target head slices, 4 draft pages
NUM_TOKENS = 40  # 10 target pages, the draft's 24-token window
HIDDEN = 8
TIMEOUT_S = 20.0
CASES = ("pages", "packed", "sliced")
SLICED = {
    "target": HeadRoute(0, 0, slice(1, 2), slice(0, 1), False),
    "draft": HeadRoute(0, 0, slice(0, 1), slice(0, 1), False),
}
WHOLE = slice(None)


def capped_config() -> CacheConfig:
    return make_config(
        page=4, window=24, k=2, target_pages=32, draft_pages=32, draft_layers=4, draft_dtype="bfloat16"
    )


def case_tag(case: str) -> int:
    return request_tag(f"capped-{case}")


def heads_of(case: str, side: str) -> dict[str, slice]:
    """Per group, the heads of a page that travel (``side`` "send") or land ("recv")."""
    if case != "sliced":
        return {"target": WHOLE, "draft": WHOLE}
    return {g: r.src_heads if side == "send" else r.dst_heads for g, r in SLICED.items()}


class RecordingTransport(UcxTransport):
    """A UcxTransport that notes (group index, chunk, bytes) of every message it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[int, int, int]] = []

    async def send(self, peer_id: str, buffer, tag: int, timeout_s: float | None = None) -> None:
        _, group, chunk = split_tag(tag)
        nbytes = buffer.numel() * buffer.element_size() if isinstance(buffer, torch.Tensor) else len(buffer)
        self.sent.append((group, chunk, nbytes))
        await super().send(peer_id, buffer, tag, timeout_s)


def bits(pool: torch.Tensor, ids: list[int], heads: slice) -> bytes:
    """The bits of pages ``ids`` of ``pool``, only ``heads``."""
    return pool[ids][:, :, :, heads].contiguous().view(torch.uint8).cpu().numpy().tobytes()


def child(role: str, device: str, conn) -> None:
    os.environ.update(LOOPBACK_ENV)
    asyncio.run(_side(role, device, conn))


async def _side(role: str, device: str, conn) -> None:
    transport = RecordingTransport()
    await transport.start()
    states = {c: _state(role, device, c) for c in CASES}
    rows = {c: {g: m.block_table(c, g) for g in m.groups} for c, (m, _) in states.items()}
    conn.send((transport.local_info(), rows if role == "recv" else None))
    info, peer_rows = await asyncio.to_thread(conn.recv)
    peer = "recv" if role == "send" else "send"
    await transport.connect(peer, info)
    report = {}
    for case, (manager, pools) in states.items():
        if role == "send":
            await _send(case, (manager, pools), transport, PeerRank(peer, info), peer_rows[case])
        else:
            await _receive(case, (manager, pools), transport, PeerRank(peer, info))
        report[case] = _outcome(case, role, manager, pools, transport)
        transport.sent = []
    conn.send(report)
    await asyncio.to_thread(conn.recv)  # both done: safe to close
    await transport.close()


def _state(role: str, device: str, case: str) -> tuple[KVCacheManager, KVPools]:
    """One case's cache, pools of its own: the sender's seeded and prefilled, the
    receiver's zeroed and reserved behind another request's pages (so its page ids differ
    from the sender's)."""
    config = capped_config()
    if role == "send":
        seeded_pools = seeded(KVPools.allocate(config), 7).tensors()
        pools = KVPools({g: t.to(device) for g, t in seeded_pools.items()})
        manager = KVCacheManager(config, pools)
        manager.allocate(case, NUM_TOKENS)
        manager.advance(case, NUM_TOKENS)
        return manager, pools
    pools = KVPools.allocate(config, device)
    manager = KVCacheManager(config, pools)
    manager.allocate("other", 20)
    assert manager.reserve_for_transfer(case, NUM_TOKENS) is not None
    return manager, pools


async def _send(case: str, state, transport, peer: PeerRank, dest) -> None:
    manager, pools = state
    if case != "sliced":
        agent = TransferAgent(manager, pools, HIDDEN, transport, max_message_bytes=CAP)
        agent.pair(peer.instance_id, [peer])
        aux = AuxState(NUM_TOKENS, 42, torch.zeros(HIDDEN), "send")
        rows = dest if case == "pages" else None
        tag = case_tag(case)
        await agent.send_request(case, NUM_TOKENS, peer.instance_id, aux, TIMEOUT_S, rows, tag=tag)
        return
    rank = RankTransfer(pools, list(manager.groups), transport, max_message_bytes=CAP)
    pages = manager.transfer_pages(case, NUM_TOKENS)
    await rank.send(SendJob(case, peer.instance_id, 0, pages, SLICED, TIMEOUT_S, dest, case_tag(case)))
    ack = torch.zeros(1, dtype=torch.uint8)
    await transport.recv(ack, message_tag(case_tag(case), ACK_GROUP, 0), TIMEOUT_S)


async def _receive(case: str, state, transport, peer: PeerRank) -> None:
    manager, pools = state
    if case != "sliced":
        agent = TransferAgent(manager, pools, HIDDEN, transport)  # the default cap: it follows the header
        agent.pair(peer.instance_id, [peer])
        await agent.receive_request(case, NUM_TOKENS, TIMEOUT_S, case_tag(case))
        return
    rank = RankTransfer(pools, list(manager.groups), transport)
    pages = manager.transfer_pages(case, NUM_TOKENS)
    await rank.recv(RecvJob(case, pages, {0: SLICED}, TIMEOUT_S, case_tag(case)))
    ack = torch.ones(1, dtype=torch.uint8)
    await transport.send(peer.instance_id, ack, message_tag(case_tag(case), ACK_GROUP, 0), TIMEOUT_S)


def _outcome(case: str, role: str, manager: KVCacheManager, pools: KVPools, transport) -> dict:
    """Per group: the pages' ids, the bits of their travelling heads, the bits of the rest
    of the pool (every other page, and the pages' other heads); then every page message
    sent, and the pages in use once the request is freed."""
    groups = {}
    for g, p in manager.transfer_pages(case, NUM_TOKENS).items():
        pool, heads = pools.tensor(g), heads_of(case, role)[g]
        rest = torch.ones(pool.shape[:4], dtype=torch.bool, device=pool.device)
        rest[p.page_ids, :, :, heads] = False
        groups[g] = (p.page_ids, bits(pool, p.page_ids, heads), bool(pool[rest].eq(0).all()))
    manager.free(case)
    if role == "recv":
        manager.free("other")
    manager.reset_prefix_cache()
    used = {g: u.used for g, u in manager.usage().items()}
    return {"groups": groups, "messages": list(transport.sent), "used": used}


def run_pair(device: str) -> dict[str, dict]:
    """Run both sides on ``device`` (spawned processes); role -> its report."""
    ctx = mp.get_context("spawn")
    pipes = {role: ctx.Pipe() for role in ("send", "recv")}
    procs = [ctx.Process(target=child, args=(r, device, p[1]), daemon=True) for r, p in pipes.items()]
    for p in procs:
        p.start()
    try:
        hello = {role: _answer(p[0]) for role, p in pipes.items()}
        pipes["send"][0].send((hello["recv"][0], hello["recv"][1]))
        pipes["recv"][0].send((hello["send"][0], None))
        reports = {role: _answer(p[0]) for role, p in pipes.items()}
        for p in pipes.values():
            p[0].send("done")
        return reports
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT_S)
            if p.is_alive():
                p.kill()


def _answer(conn, timeout_s: float = 90.0):
    if not conn.poll(timeout_s):
        raise TimeoutError("child process did not answer")
    return conn.recv()


def check_landed(reports: dict[str, dict], case: str) -> None:
    """Bits equal, page ids the receiver's own, nothing else written."""
    sent, got = reports["send"][case]["groups"], reports["recv"][case]["groups"]
    assert set(got) == set(sent) == {"target", "draft"}
    for g, (ids, bits, _) in got.items():
        sent_ids, sent_bits, _ = sent[g]
        assert len(ids) == len(sent_ids) > 0
        assert ids != sent_ids  # the receiver's pages sit behind another request's
        assert bits == sent_bits, (case, g)
        assert got[g][2], f"{case}/{g}: bits written outside the reserved pages' heads"


def check_capped(reports: dict[str, dict], case: str) -> None:
    """Every page message within the cap; the groups' bytes in as many as they need."""
    index = {g.name: i for i, g in enumerate(capped_config().groups)}
    sent = reports["send"][case]
    for g, i in index.items():
        sizes = [n for group, chunk, n in sent["messages"] if group == i and chunk > 0]
        total = len(sent["groups"][g][1])
        assert sum(sizes) == total
        assert max(sizes) <= CAP
        assert len(sizes) >= math.ceil(total / CAP) and len(sizes) > 1, (case, g, sizes)
