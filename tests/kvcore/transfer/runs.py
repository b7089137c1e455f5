"""How the sessions of tests/kvcore/transfer/test_agent.py run, per backend:

- ``"fake"``: every side a coroutine of the test's own event loop, each with its own
  :class:`~tests.kvcore.transfer.fake_transport.FakeTransport` of one network;
- a real backend (``"ucx"``, any name of ``kvcore.transfer.BACKENDS``): one spawned process
  per side, each with its own transport (UCX: over loopback).

The sides run the same code either way (:mod:`~tests.kvcore.transfer.sessions`,
:mod:`~tests.kvcore.transfer.pair_session`), so the tests' assertions hold for both.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from collections.abc import Awaitable, Coroutine

from tests.kvcore.transfer import pair_session, sessions
from tests.kvcore.transfer.conns import ProcessConn, local_pipe
from tests.kvcore.transfer.fake_transport import FakeNetwork
from tests.kvcore.transfer.sessions import RANKS

BACKENDS = ("ucx", "fake")
ANSWER_S = 90.0  # how long the parent waits for each side's message (fake: for all of them)


def tp_reports(backend: str) -> dict[str, dict]:
    """Every rank's report of the TP groups' session (sessions.py)."""
    if backend == "fake":
        return asyncio.run(_tp_in_one_loop())
    ctx = mp.get_context("spawn")
    parents, ends = zip(*(ctx.Pipe() for _ in RANKS), strict=True)
    p_pipe, d_pipe = ctx.Pipe(), ctx.Pipe()
    siblings = {"P0": p_pipe[0], "P1": p_pipe[1], "D0": d_pipe[0], "D1": d_pipe[1]}
    children = [
        ctx.Process(target=sessions.tp_child, args=(n, end, siblings[n], backend), daemon=True)
        for n, end in zip(RANKS, ends, strict=True)
    ]
    conns = {n: ProcessConn(c, ANSWER_S) for n, c in zip(RANKS, parents, strict=True)}
    return _in_processes(children, sessions.lead_tp(conns))


def pair_reports(backend: str) -> tuple[dict, dict]:
    """The prefill and the decode side's reports of the TP 1 pair's session (pair_session.py)."""
    if backend == "fake":
        return asyncio.run(_pair_in_one_loop())
    ctx = mp.get_context("spawn")
    pipes = {r: ctx.Pipe() for r in pair_session.ROLES}
    children = [
        ctx.Process(target=pair_session.pair_child, args=(r, pipes[r][1], backend), daemon=True)
        for r in pipes
    ]
    conns = {r: ProcessConn(pipes[r][0], ANSWER_S) for r in pipes}
    return _in_processes(children, pair_session.lead_pair(conns))


def _in_processes(children: list[mp.Process], lead: Coroutine):
    """``lead``'s outcome with ``children`` started; every child joined (or killed) after."""
    for child in children:
        child.start()
    try:
        return asyncio.run(lead)
    finally:
        for child in children:
            child.join(timeout=sessions.TIMEOUT_S)
            if child.is_alive():
                child.kill()


async def _tp_in_one_loop() -> dict[str, dict]:
    network = FakeNetwork()
    parents, ends = zip(*(local_pipe() for _ in RANKS), strict=True)
    p_pipe, d_pipe = local_pipe(), local_pipe()
    siblings = {"P0": p_pipe[0], "P1": p_pipe[1], "D0": d_pipe[0], "D1": d_pipe[1]}
    sides = [
        sessions.tp_rank(n, end, siblings[n], network.transport()) for n, end in zip(RANKS, ends, strict=True)
    ]
    return await _with_sides(sessions.lead_tp(dict(zip(RANKS, parents, strict=True))), sides)


async def _pair_in_one_loop() -> tuple[dict, dict]:
    network = FakeNetwork()
    pipes = {r: local_pipe() for r in pair_session.ROLES}
    sides = [pair_session.pair_side(r, pipes[r][1], network.transport()) for r in pipes]
    return await _with_sides(pair_session.lead_pair({r: pipes[r][0] for r in pipes}), sides)


async def _with_sides(lead: Awaitable, sides: list[Awaitable]):
    """``lead``'s outcome, the sides running beside it; the first failure of any is raised."""
    outcomes = await asyncio.wait_for(asyncio.gather(lead, *sides), ANSWER_S)
    return outcomes[0]
