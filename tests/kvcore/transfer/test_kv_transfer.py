"""A request's unified pages move between two real processes over UCX, bit-exactly.

The "prefill" process fills its pools with seeded random bits, sends request "r"; the
"decode" process reserves pages, receives into them and reports what landed. The parent
rebuilds the sender's pools from the seed and compares page by page.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os

import pytest
import torch

from kvcore import KVLayout
from kvcore.transfer.ucx import LOOPBACK_ENV
from tests.kvcore.conftest import make_manager

NUM_TOKENS = 22
HIDDEN = 8
TIMEOUT_S = 10.0
CONFIG = dict(page=4, window=8, k=2, target_pages=16, draft_pages=16, draft_dtype="bfloat16")


def seeded_manager(layout: KVLayout, seed: int, target_window: int = 0):
    """A manager whose pools hold seeded random bits, with request "r" prefilled (sender).
    Children report plain bytes and lists: tensors through a pipe travel as file
    descriptors, which a child exiting first would close."""
    m = make_manager(layout=layout, target_window=target_window, **CONFIG)
    gen = torch.Generator().manual_seed(seed)
    for pool in m.pools.values():
        bits = pool.view(torch.uint8)
        bits.copy_(torch.randint(0, 256, bits.shape, dtype=torch.uint8, generator=gen))
    m.allocate("r", NUM_TOKENS)
    m.advance("r", NUM_TOKENS)
    return m


def _child(role: str, layout: KVLayout, target_window: int, conn) -> None:
    os.environ.update(LOOPBACK_ENV)
    asyncio.run(_session(role, layout, target_window, conn))


async def _session(role: str, layout: KVLayout, target_window: int, conn) -> None:
    from kvcore.transfer.kv_transfer import AuxState, KVTransferAgent
    from kvcore.transfer.ucx import TransferTimeout, UcxEndpointInfo

    manager = (
        seeded_manager(layout, 7, target_window)
        if role == "prefill"
        else make_manager(layout=layout, target_window=target_window, **CONFIG)
    )
    agent = KVTransferAgent(manager, hidden_size=HIDDEN)
    await agent.start()
    rows = None
    if role == "decode":  # reserve first: the prefill side learns the rows, as from Reserve
        manager.allocate("r", NUM_TOKENS, num_computed=NUM_TOKENS)
        rows = {g: manager.block_table("r", g) for g in manager.groups}
    conn.send((dataclasses.astuple(agent.endpoint()), rows))
    info, peer_rows = await asyncio.to_thread(conn.recv)
    peer = UcxEndpointInfo(*info)
    peer_id = "decode" if role == "prefill" else "prefill"
    await agent.connect(peer_id, peer)
    if role == "prefill":
        aux = AuxState(NUM_TOKENS, 42, torch.arange(HIDDEN, dtype=torch.float32), "prefill")
        dest = peer_rows if layout == KVLayout.UNIFIED else None  # both paths: direct and packed
        usage = await agent.send_request("r", NUM_TOKENS, "decode", aux, TIMEOUT_S, dest)
        await agent.ping("decode", "pair-1", TIMEOUT_S)
        conn.send({"bytes": usage.bytes})
    else:
        aux, usage = await agent.receive_request("r", NUM_TOKENS, TIMEOUT_S)
        await agent.pong("prefill", "pair-1", TIMEOUT_S)
        landed = {
            g: (p.first_page, p.page_ids, manager.pools[g][p.page_ids].view(torch.uint8).numpy().tobytes())
            for g, p in manager.transfer_pages("r", NUM_TOKENS).items()
        }
        manager.free("r")
        try:  # nobody sends request "s": the receive times out, and nothing leaks
            manager.allocate("s", 8, num_computed=8)
            await agent.receive_request("s", 8, 0.3)
            silent = "no error"
        except TransferTimeout:
            silent = "TransferTimeout"
        manager.free("s")
        conn.send(
            {
                "aux": (aux.prompt_len, aux.first_token_id, aux.hidden.tolist(), aux.sender_id),
                "bytes": usage.bytes,
                "landed": landed,
                "silent": silent,
                "used": {g: u.used for g, u in manager.usage().items()},
            }
        )
    await agent.close()


def run_pair(layout: KVLayout, target_window: int = 0) -> tuple[dict, dict]:
    ctx = mp.get_context("spawn")
    pipes = {r: ctx.Pipe() for r in ("prefill", "decode")}
    procs = {
        r: ctx.Process(target=_child, args=(r, layout, target_window, pipes[r][1]), daemon=True)
        for r in pipes
    }
    for p in procs.values():
        p.start()
    try:
        parent = {r: pipes[r][0] for r in pipes}
        infos = {r: _recv(parent[r]) for r in parent}
        parent["prefill"].send(infos["decode"])
        parent["decode"].send(infos["prefill"])
        return _recv(parent["prefill"]), _recv(parent["decode"])
    finally:
        for p in procs.values():
            p.join(timeout=TIMEOUT_S)
            if p.is_alive():
                p.kill()


def _recv(conn):
    if not conn.poll(30):
        raise TimeoutError("child process did not answer")
    return conn.recv()


@pytest.mark.parametrize(
    ("layout", "target_window"), [(KVLayout.UNIFIED, 0), (KVLayout.SEPARATE, 0), (KVLayout.UNIFIED, 8)]
)
def test_pages_of_every_group_land_bit_exactly(layout, target_window):
    sent, got = run_pair(layout, target_window)
    sender = seeded_manager(layout, 7, target_window)
    expected = sender.transfer_pages("r", NUM_TOKENS)
    groups = {"target", "draft"} if layout == KVLayout.UNIFIED else {"target"}
    assert set(got["landed"]) == groups
    for g in groups:
        first, ids, bits = got["landed"][g]
        assert first == expected[g].first_page
        assert len(ids) == len(expected[g].page_ids)
        assert bits == sender.pools[g][expected[g].page_ids].view(torch.uint8).numpy().tobytes()
    windowed = ["draft"] if layout == KVLayout.UNIFIED else []
    for g in windowed + (["target"] if target_window else []):  # the window at 22: pages 3..5
        assert got["landed"][g][0] == 3
        assert len(got["landed"][g][1]) == 3
    if not target_window:
        assert got["landed"]["target"][0] == 0
    page_bytes = {g: sender.groups[g].page_bytes(4) for g in groups}
    assert got["bytes"] == sent["bytes"] == {g: page_bytes[g] * len(expected[g].page_ids) for g in groups}
    assert got["aux"] == (NUM_TOKENS, 42, [float(i) for i in range(HIDDEN)], "prefill")
    assert got["silent"] == "TransferTimeout"
    assert got["used"] == {"target": 0, "draft": 0}
