"""The TP groups of tests/kvcore/transfer/test_agent.py: four ranks, real agents over
one transport each (the TP 1 pair is :mod:`tests.kvcore.transfer.pair_session`; how the
sides run, processes over UCX or coroutines over the fake: :mod:`tests.kvcore.transfer.runs`).

Each side is one rank of one worker, with its own transport shared by every scenario it
takes part in. Rank 0 of a worker runs the TransferAgent the servers run; rank 1 runs its
RankTransfer on rank 0's jobs, carried by a pipe (:mod:`tests.kvcore.transfer.rank_pipe`).
Sides report plain bytes and lists: tensors through a process pipe travel as file
descriptors, which a child exiting first would close.
"""

from __future__ import annotations

import asyncio
import os

import torch

from kvcore import (
    AuxState,
    CacheConfig,
    KVCacheManager,
    KVPools,
    LayerGroupSpec,
    Lifecycle,
    Owner,
)
from kvcore.transfer import PeerRank, RankTransfer, TransferAgent, Transport, heads_of_rank, new_transport
from kvcore.transfer.tags import AUX_GROUP, message_tag, request_tag
from kvcore.transfer.ucx import LOOPBACK_ENV
from tests.kvcore.transfer.conns import ProcessConn
from tests.kvcore.transfer.rank_pipe import PipeClient, PipeLinks, serve_pipe

RANKS = ("P0", "P1", "D0", "D1")
HEADS = {"target": 4, "draft": 1}  # KV heads of the whole layer: split 2 + 2, replicated
NUM_TOKENS = 22
HIDDEN = 8
TIMEOUT_S = 20.0
SCENARIOS = [(1, 1), (1, 2), (2, 1), (2, 2)]  # (prefill TP, decode TP)
CANCELLED = "cancelled"  # the 2 -> 2 request whose receive is cancelled mid-way


def tp_config(tp: int) -> CacheConfig:
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
    return CacheConfig(groups=groups, tokens_per_page=4, num_pages=(32, 32), num_spec_tokens=2)


def seeded(pools: KVPools, seed: int) -> KVPools:
    """``pools`` filled with seeded random bits."""
    gen = torch.Generator().manual_seed(seed)
    for pool in pools.tensors().values():
        bits = pool.view(torch.uint8)
        bits.copy_(torch.randint(0, 256, bits.shape, dtype=torch.uint8, generator=gen))
    return pools


def rid(src_tp: int, dst_tp: int) -> str:
    return f"r{src_tp}{dst_tp}"


def tp_of(side: str, scenario: tuple[int, int]) -> int:
    return scenario[0] if side == "P" else scenario[1]


def landed(manager: KVCacheManager, pools: KVPools, request_id: str, held=None) -> dict:
    """Per travelling group: (first page, page ids, their bytes) of ``request_id``."""
    return {
        g: (p.first_page, p.page_ids, pools.tensor(g)[p.page_ids].view(torch.uint8).numpy().tobytes())
        for g, p in manager.transfer_pages(request_id, NUM_TOKENS, held).items()
    }


# ---------------------------------------------------------------- TP groups, four ranks


async def lead_tp(parents: dict) -> dict[str, dict]:
    """The parent of the four ranks (``parents``: its conn to each): hand every rank the
    others' endpoints and the decode side's rows, then collect their reports."""
    hello = {n: await parents[n].recv() for n in RANKS}
    endpoints = {n: h[0] for n, h in hello.items()}
    for conn in parents.values():
        conn.send((endpoints, hello["D0"][1]))
    return {n: await parents[n].recv() for n in RANKS}


def tp_child(name: str, parent, sibling, backend: str) -> None:
    """A rank as a process over ``backend`` (``parent``, ``sibling``: multiprocessing pipe ends)."""
    os.environ.update(LOOPBACK_ENV)
    asyncio.run(tp_rank(name, ProcessConn(parent), ProcessConn(sibling), new_transport(backend)))


def rank_state(side: str, rank: int, scenario: tuple[int, int]) -> tuple[KVCacheManager, KVPools]:
    """One rank's cache for one scenario. Every rank of a worker makes the same page
    decisions; a prefill rank's pools hold its heads of one seeded whole pool."""
    tp, r = tp_of(side, scenario), rid(*scenario)
    pools = KVPools.allocate(tp_config(tp))
    manager = KVCacheManager(tp_config(tp), pools)
    if side == "P":
        for g, whole in seeded(KVPools.allocate(tp_config(1)), 7).tensors().items():
            held = heads_of_rank(HEADS[g], tp, rank)
            pools.tensor(g).copy_(whole[:, :, :, held.start : held.stop])
        manager.allocate(r, NUM_TOKENS)
        manager.advance(r, NUM_TOKENS)
        return manager, pools
    manager.allocate("other", 4 * sum(scenario))  # other page ids than the sender's
    manager.reserve_for_transfer(r, NUM_TOKENS)
    if scenario == (2, 2):
        assert manager.reserve_for_transfer(CANCELLED, NUM_TOKENS) is not None
    return manager, pools


async def tp_rank(name: str, parent, sibling, transport: Transport) -> None:
    """Rank ``name`` (e.g. "P0") on ``transport``, not yet started; ``parent`` and ``sibling``
    are its conns to the parent and to the other rank of its worker."""
    side, rank = name[0], int(name[1])
    await transport.start()
    states = {sc: rank_state(side, rank, sc) for sc in SCENARIOS if rank < tp_of(side, sc)}
    rows = {
        rid(*sc): {g: m.block_table(rid(*sc), g) for g in m.groups}
        for sc, (m, _) in states.items()
        if side == "D"
    }
    parent.send((transport.local_info(), rows))
    endpoints, dest = await parent.recv()
    if rank == 1:
        ranks = {sc: RankTransfer(pools, list(m.groups), transport) for sc, (m, pools) in states.items()}
        report = {"outcomes": await serve_pipe(sibling, ranks)}
    else:
        report = await _lead_rank(side, states, transport, PipeClient(sibling), endpoints, dest)
    if side == "D":
        report["landed"] = {rid(*sc): landed(m, pools, rid(*sc)) for sc, (m, pools) in states.items()}
    parent.send(report)
    await transport.close()


async def _lead_rank(side, states, transport, client: PipeClient, endpoints, dest) -> dict:
    """Rank 0: pair every scenario's agent in turn, run every transfer at once, then the
    cancelled receive (2 -> 2)."""
    agents = {}
    for sc, (m, pools) in states.items():
        links = PipeLinks(client, sc) if tp_of(side, sc) == 2 else None
        agents[sc] = TransferAgent(m, pools, HIDDEN, transport, links, total_heads=HEADS)
        await _pair(agents[sc], side, sc, endpoints)
    usage = await asyncio.gather(*(_transfer(side, sc, a, dest) for sc, a in agents.items()))
    report = {"usage": {rid(*sc): (u.bytes, u.pages) for sc, u in zip(agents, usage, strict=True)}}
    if side == "P":
        aux = AuxState(NUM_TOKENS, 42, torch.zeros(HIDDEN), "P0")  # the aux alone, no pages
        await transport.send("D0", aux.to_bytes(), message_tag(request_tag(CANCELLED), AUX_GROUP, 0), 5.0)
    else:
        report["cancel"] = await _cancel_mid_receive(agents[(2, 2)], client)
    client.stop()
    return report


async def _pair(agent: TransferAgent, side: str, scenario: tuple[int, int], endpoints) -> None:
    other = "D" if side == "P" else "P"
    peer = [PeerRank(f"{other}{r}", endpoints[f"{other}{r}"]) for r in range(tp_of(other, scenario))]
    await agent.connect(peer[0].instance_id, peer[0].endpoint)
    agent.pair(peer[0].instance_id, peer)
    await agent.test_links(peer, lead=side == "P", nonce=f"pair-{rid(*scenario)}")


async def _transfer(side: str, scenario: tuple[int, int], agent: TransferAgent, dest):
    r = rid(*scenario)
    if side == "P":
        aux = AuxState(NUM_TOKENS, 42, torch.arange(HIDDEN, dtype=torch.float32), "P0")
        return await agent.send_request(r, NUM_TOKENS, "D0", aux, TIMEOUT_S, dest[r], tag=attempt_tag(r))
    aux, usage = await agent.receive_request(r, NUM_TOKENS, TIMEOUT_S, attempt_tag(r))
    assert (aux.first_token_id, aux.hidden.tolist()) == (42, list(range(HIDDEN)))
    return usage


async def _cancel_mid_receive(agent: TransferAgent, client: PipeClient) -> str:
    """Receive a request whose pages never come; cancel once rank 1 holds its job."""
    task = asyncio.ensure_future(agent.receive_request(CANCELLED, NUM_TOKENS, TIMEOUT_S))
    while not client.pending and not task.done():
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    task.cancel()
    outcome = (await asyncio.gather(task, return_exceptions=True))[0]
    return type(outcome).__name__


def attempt_tag(request_id: str) -> int:
    """The base tag both sides use, as a reservation would carry it: not the request's own,
    so every rank's messages must follow the given tag."""
    return request_tag(f"{request_id}-attempt-2")
