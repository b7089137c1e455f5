"""The TP 1 pair of tests/kvcore/transfer/test_agent.py: a prefill and a decode side
run every layout's transfer through their agents, the side channel, and a receive that
nobody sends (as processes over UCX, or coroutines over the fake transport:
:mod:`tests.kvcore.transfer.runs`)."""

from __future__ import annotations

import asyncio
import os

import torch

from kvcore import AuxState, CacheConfig, KVCacheManager, KVLayout, KVPools
from kvcore.transfer import (
    PairingMessage,
    PeerRank,
    TransferAgent,
    TransferError,
    TransferTimeout,
    Transport,
    new_transport,
)
from kvcore.transfer.tags import request_tag
from kvcore.transfer.ucx import LOOPBACK_ENV
from tests.kvcore.conftest import make_config
from tests.kvcore.transfer.conns import ProcessConn
from tests.kvcore.transfer.sessions import HIDDEN, NUM_TOKENS, TIMEOUT_S, landed, seeded

ROLES = ("prefill", "decode")
PROMPT = list(range(1, NUM_TOKENS + 1))
CASES = {  # name -> (layout, target window, decode holds the prompt's first 12 tokens)
    "unified": (KVLayout.UNIFIED, 0, False),
    "separate": (KVLayout.SEPARATE, 0, False),
    "windowed": (KVLayout.UNIFIED, 8, False),
    "held": (KVLayout.UNIFIED, 0, True),
}
PAIR_CONFIG = dict(page=4, window=8, k=2, target_pages=16, draft_pages=16, draft_dtype="bfloat16")
NONCE = "pair-1"
WIDE = HIDDEN + 1  # a sender whose aux state is wider than the receiver takes
REFUSED_TAG = request_tag("refused")


def pair_config(case: str) -> CacheConfig:
    layout, target_window, _ = CASES[case]
    return make_config(layout=layout, target_window=target_window, **PAIR_CONFIG)


def sender_state(case: str) -> tuple[KVCacheManager, KVPools]:
    """The prefill side of ``case``: seeded pools, request "r" prefilled."""
    pools = seeded(KVPools.allocate(pair_config(case)), 7)
    manager = KVCacheManager(pair_config(case), pools)
    manager.allocate("r", NUM_TOKENS)
    manager.advance("r", NUM_TOKENS)
    return manager, pools


def _receiver_state(case: str):
    """The decode side of ``case``: "r" reserved, with the prompt's cached pages held."""
    pools = KVPools.allocate(pair_config(case))
    manager = KVCacheManager(pair_config(case), pools)
    if CASES[case][2]:
        manager.allocate("warm", 12)
        manager.advance("warm", 12)
        manager.free("warm", PROMPT[:12])
    reservation = manager.reserve_for_transfer("r", NUM_TOKENS, PROMPT if CASES[case][2] else ())
    return manager, pools, reservation


async def lead_pair(parents: dict) -> tuple[dict, dict]:
    """The parent of the two sides (``parents``: its conn to each): hand each the other's
    endpoint (the prefill side the decode side's reservations too); their reports."""
    hello = {r: await parents[r].recv() for r in ROLES}
    parents["prefill"].send(hello["decode"])
    parents["decode"].send((hello["prefill"][0], {}))
    return await parents["prefill"].recv(), await parents["decode"].recv()


def pair_child(role: str, conn, backend: str) -> None:
    """A side as a process over ``backend`` (``conn``: its multiprocessing pipe end)."""
    os.environ.update(LOOPBACK_ENV)
    asyncio.run(pair_side(role, ProcessConn(conn), new_transport(backend)))


async def pair_side(role: str, conn, transport: Transport) -> None:
    """Side ``role`` on ``transport``, not yet started; ``conn`` to the parent."""
    await transport.start()
    states = {c: sender_state(c) if role == "prefill" else _receiver_state(c) for c in CASES}
    reservations = {c: (s[2].block_tables, s[2].num_held) for c, s in states.items() if role == "decode"}
    conn.send((transport.local_info(), reservations))
    endpoint, peer_reservations = await conn.recv()
    peer_id = "decode" if role == "prefill" else "prefill"
    agents = {c: TransferAgent(s[0], s[1], HIDDEN, transport) for c, s in states.items()}
    for agent in agents.values():
        await agent.connect(peer_id, endpoint)
        agent.pair(peer_id, [PeerRank(peer_id, endpoint)])
    if role == "prefill":
        report = await _send_cases(agents, peer_reservations)
    else:
        report = await _receive_cases(agents, states)
    conn.send(report)
    await transport.close()


async def _send_cases(agents: dict[str, TransferAgent], reservations) -> dict:
    """Every case in turn (the separate one packed, the others pool to pool), then the
    side channel's lead."""
    report = {}
    for case, agent in agents.items():
        rows, held = reservations[case]
        aux = AuxState(NUM_TOKENS, 42, torch.arange(HIDDEN, dtype=torch.float32), "prefill")
        dest = None if case == "separate" else rows
        usage = await agent.send_request("r", NUM_TOKENS, "decode", aux, TIMEOUT_S, dest, held)
        report[case] = (usage.bytes, usage.pages, usage.held)
    report["refused"] = await _refused_send(agents["unified"])
    side = agents["unified"].side_channel  # the link the refusal aborted connects again
    await side.ping("decode", NONCE, TIMEOUT_S)
    await side.send_message("decode", NONCE, PairingMessage.SENDER_RANKS, b"ranks", TIMEOUT_S)
    report["verdict"] = await side.receive_message(NONCE, PairingMessage.RECEIVER_VERDICT, TIMEOUT_S)
    await side.send_message("decode", NONCE, PairingMessage.SENDER_VERDICT, b"", TIMEOUT_S)
    return report


async def _receive_cases(agents: dict[str, TransferAgent], states) -> dict:
    """Every case in turn, the side channel's answer, then a receive nobody sends."""
    report = {}
    for case, agent in agents.items():
        manager, pools, reservation = states[case]
        aux, usage = await agent.receive_request("r", NUM_TOKENS, TIMEOUT_S)
        got = landed(manager, pools, "r", reservation.num_held)
        aux_fields = (aux.prompt_len, aux.first_token_id, aux.hidden.tolist(), aux.sender_id)
        report[case] = (usage.bytes, usage.pages, usage.held, got, aux_fields)
        manager.free("r")
    report["refusing"] = await _refusing_receive(agents["unified"], states["unified"][0])
    side = agents["unified"].side_channel
    await side.pong("prefill", NONCE, TIMEOUT_S)
    report["ranks"] = await side.receive_message(NONCE, PairingMessage.SENDER_RANKS, TIMEOUT_S)
    await side.send_message("prefill", NONCE, PairingMessage.RECEIVER_VERDICT, b"accepted", TIMEOUT_S)
    report["final"] = await side.receive_message(NONCE, PairingMessage.SENDER_VERDICT, TIMEOUT_S)
    report["silent"] = await _silent_receive(agents["unified"], states["unified"][0])
    report["used"] = {g: u.used for g, u in states["unified"][0].usage().items()}
    return report


async def _silent_receive(agent: TransferAgent, manager: KVCacheManager) -> str:
    """Nobody sends request "s": the receive times out, and its pages are freed."""
    manager.reserve_for_transfer("s", 8)
    try:
        await agent.receive_request("s", 8, 0.3)
        outcome = "no error"
    except TransferTimeout:
        outcome = "TransferTimeout"
    manager.free("s")
    return outcome


async def _refused_send(agent: TransferAgent) -> str:
    """A sender of WIDE hidden values: the receiver refuses it, and the sender hears why
    (rather than waiting out TIMEOUT_S for an acknowledgement)."""
    wide = TransferAgent(agent.manager, agent.fanout.rank0.pools, WIDE, agent.rank0.transport)
    wide.pair("decode", agent._peers["decode"])
    aux = AuxState(NUM_TOKENS, 42, torch.zeros(WIDE), "prefill")
    try:
        await wide.send_request("r", NUM_TOKENS, "decode", aux, TIMEOUT_S, tag=REFUSED_TAG)
    except TransferTimeout as e:
        return f"timed out: {e}"
    except TransferError as e:
        return str(e)
    return "no error"


async def _refusing_receive(agent: TransferAgent, manager: KVCacheManager) -> str:
    """Receives the WIDE sender's request: refused, its pages freed."""
    manager.reserve_for_transfer("r", NUM_TOKENS)
    try:
        await agent.receive_request("r", NUM_TOKENS, TIMEOUT_S, tag=REFUSED_TAG)
        outcome = "no error"
    except TransferError as e:
        outcome = str(e)
    manager.free("r")
    return outcome
