"""Pages cross between TP groups of different sizes, each rank moving only its heads.

Four processes (prefill ranks P0, P1; decode ranks D0, D1) host three transfers at once:
TP 1 -> 2, 2 -> 1 and 2 -> 2. The target group has 4 KV heads (split 2 + 2 under TP2), the
windowed draft group 1 (replicated under TP2). Every prefill rank's pools hold its heads
of one seeded "whole" pool; the parent checks that each decode rank's reserved pages hold
exactly its heads of the sender's pages, bit for bit.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os

import torch

from kvcore import CacheConfig, KVCacheManager, LayerGroupSpec, Lifecycle, Owner
from kvcore.transfer.head_routes import head_routes, heads_of_rank, routes_between
from kvcore.transfer.ucx import LOOPBACK_ENV

HEADS = {"target": 4, "draft": 1}
NUM_TOKENS = 22
HIDDEN = 8
TIMEOUT_S = 20.0
SCENARIOS = [(1, 2), (2, 1), (2, 2)]  # (prefill TP, decode TP)
RANKS = ["P0", "P1", "D0", "D1"]


def manager(tp: int) -> KVCacheManager:
    groups = tuple(
        LayerGroupSpec(
            g,
            owner,
            num_layers=2 if g == "target" else 1,
            num_kv_heads=len(heads_of_rank(h, tp, 0)),
            head_dim=4,
            dtype="float32" if g == "target" else "bfloat16",
            window=0 if g == "target" else 8,
            lifecycle=Lifecycle.REQUIRED if g == "target" else Lifecycle.OPTIONAL,
        )
        for (g, h), owner in zip(HEADS.items(), (Owner.TARGET, Owner.DRAFT), strict=True)
    )
    return KVCacheManager(
        CacheConfig(groups=groups, tokens_per_page=4, num_pages=(16, 16), num_spec_tokens=2)
    )


def whole_pools(seed: int) -> dict[str, torch.Tensor]:
    """The TP1 sender's pools: seeded random bits."""
    pools = manager(1).pools
    gen = torch.Generator().manual_seed(seed)
    for pool in pools.values():
        bits = pool.view(torch.uint8)
        bits.copy_(torch.randint(0, 256, bits.shape, dtype=torch.uint8, generator=gen))
    return pools


def rid(src_tp: int, dst_tp: int) -> str:
    return f"r{src_tp}{dst_tp}"


def _child(name: str, conn) -> None:
    os.environ.update(LOOPBACK_ENV)
    asyncio.run(_session(name, conn))


async def _session(name: str, conn) -> None:
    from kvcore.transfer.kv_transfer import AuxState, KVTransferAgent
    from kvcore.transfer.ucx import UcxEndpointInfo, UcxTransport

    side, rank = name[0], int(name[1])
    transport = UcxTransport()
    await transport.start()
    agents, rows = {}, {}
    for src_tp, dst_tp in SCENARIOS:
        tp = src_tp if side == "P" else dst_tp
        if rank >= tp:
            continue
        m = manager(tp)
        if side == "P":
            for g, pool in whole_pools(7).items():
                pool_heads = heads_of_rank(HEADS[g], tp, rank)
                m.pools[g].copy_(pool[:, :, :, pool_heads.start : pool_heads.stop])
            m.allocate(rid(src_tp, dst_tp), NUM_TOKENS)
            m.advance(rid(src_tp, dst_tp), NUM_TOKENS)
        else:  # other page ids than the sender's: a page or two already taken
            m.allocate("other", 4 * (src_tp + dst_tp))
            m.allocate(rid(src_tp, dst_tp), NUM_TOKENS, num_computed=NUM_TOKENS)
            rows[rid(src_tp, dst_tp)] = {g: m.block_table(rid(src_tp, dst_tp), g) for g in m.groups}
        agents[(src_tp, dst_tp)] = KVTransferAgent(m, HIDDEN, transport)
    conn.send((transport.local_info().worker_address, rows))
    addresses, dest_rows = await asyncio.to_thread(conn.recv)
    for peer, address in addresses.items():
        if peer != name:
            await transport.connect(peer, UcxEndpointInfo(address))

    async def send(src_tp: int, dst_tp: int, agent: KVTransferAgent) -> None:
        r = rid(src_tp, dst_tp)
        if rank == 0:
            aux = AuxState(NUM_TOKENS, 42, torch.zeros(HIDDEN), "P0")
            await agent.send_aux(r, "D0", aux, TIMEOUT_S)
        pages = agent.manager.transfer_pages(r, NUM_TOKENS)
        routes = {g: head_routes(h, src_tp, dst_tp) for g, h in HEADS.items()}
        for dst in range(dst_tp):
            mine = {g: rt for g in HEADS if (rt := routes_between(routes[g], rank, dst))}
            if mine:
                await agent.send_pages(r, pages, f"D{dst}", TIMEOUT_S, dest_rows[r], mine, rank)
        if rank == 0:
            await agent.wait_ack(r, NUM_TOKENS, TIMEOUT_S)

    async def receive(src_tp: int, dst_tp: int, agent: KVTransferAgent):
        r = rid(src_tp, dst_tp)
        if rank == 0:
            await agent.receive_aux(r, NUM_TOKENS, TIMEOUT_S)
        pages = agent.manager.transfer_pages(r, NUM_TOKENS)
        routes = {g: head_routes(h, src_tp, dst_tp) for g, h in HEADS.items()}
        for src in range(src_tp):
            mine = {g: rt for g in HEADS if (rt := routes_between(routes[g], src, rank))}
            if mine:
                await agent.receive_pages(r, pages, TIMEOUT_S, mine, src)
        if rank == 0:
            await agent.acknowledge(r, "P0", NUM_TOKENS, TIMEOUT_S)
        return {
            g: (p.page_ids, agent.manager.pools[g][p.page_ids].view(torch.uint8).numpy().tobytes())
            for g, p in pages.items()
        }

    work = send if side == "P" else receive
    results = await asyncio.gather(*(work(s, d, a) for (s, d), a in agents.items()))
    conn.send(dict(zip([rid(s, d) for s, d in agents], results, strict=True)))
    await transport.close()


def test_each_decode_rank_holds_exactly_its_heads_of_the_prefill_pages():
    ctx = mp.get_context("spawn")
    pipes = {n: ctx.Pipe() for n in RANKS}
    procs = [ctx.Process(target=_child, args=(n, pipes[n][1]), daemon=True) for n in RANKS]
    for p in procs:
        p.start()
    try:
        hello = {n: _recv(pipes[n][0]) for n in RANKS}
        addresses = {n: h[0] for n, h in hello.items()}
        dest_rows = {r: rows for n in ("D0", "D1") for r, rows in hello[n][1].items()}
        for n in RANKS:
            pipes[n][0].send((addresses, dest_rows))
        landed = {n: _recv(pipes[n][0]) for n in RANKS}
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT_S)
            if p.is_alive():
                p.kill()
    whole = whole_pools(7)
    sender = manager(1)
    sender.allocate("r", NUM_TOKENS)
    sent = sender.transfer_pages("r", NUM_TOKENS)
    for src_tp, dst_tp in SCENARIOS:
        for dst in range(dst_tp):
            got = landed[f"D{dst}"][rid(src_tp, dst_tp)]
            assert set(got) == set(HEADS)
            for g, (ids, bits) in got.items():
                held = heads_of_rank(HEADS[g], dst_tp, dst)
                expected = whole[g][sent[g].page_ids][:, :, :, held.start : held.stop]
                assert len(ids) == len(sent[g].page_ids)
                assert bits == expected.contiguous().view(torch.uint8).numpy().tobytes(), (
                    src_tp,
                    dst_tp,
                    dst,
                    g,
                )


def _recv(conn):
    if not conn.poll(60):
        raise TimeoutError("child process did not answer")
    return conn.recv()
