"""A worker's side of pairing (the Registration service every worker serves).

``Register(rank_info = peer)`` asks this worker to pair with ``peer``: it checks the
peer's RankInfo against its own (``check_peer``, the transfer backend included), connects
its transport to the peer's endpoint, and runs its half of the test transfer: a decode
worker starts echoing, a prefill worker sends and waits for the echo. Then the two rank-0s
exchange their groups' RankInfos (every tensor-parallel rank's) and check them all
(services/worker/tp_check.py): the decode side answers with its group and its verdict, the
prefill side checks too, tests every other rank pair that will exchange pages, and tells
the decode side the outcome. Only then is the peer accepted and may take traffic; a
refusal names every mismatch.

Each attempt runs under its own nonce (``RegisterRequest.pairing_nonce``, the router's),
so messages of an attempt that was aborted midway never match a later one's. The test
transfer is the side channel's ping plus a page test: one message per layer group of a
real page's size, from and into device memory, echoed. Whatever the transport raises
refuses the pair as a ``transfer_endpoint`` mismatch (``TRANSFER_FIELD``: a transient
failure the router retries), logged once here with its cause.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from kvcore.transfer import PairingMessage, PeerRank, TransferAgent, TransferError
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from services.common.metrics import Metrics
from services.common.peer_check import (
    TRANSFER_FIELD,
    Mismatch,
    check_peer,
    format_mismatches,
    mismatches_to_proto,
)
from services.worker.tp_check import check_peer_group, group_from_bytes, group_to_bytes
from services.worker.transfer_proto import endpoint_of

PAIR_TEST_TIMEOUT_S = 10.0
MAX_NONCE_BYTES = 128
log = logging.getLogger(__name__)


def pair_nonce(prefill_id: str, decode_id: str, attempt: str = "") -> str:
    """The pairing test's nonce: the router's ``attempt`` nonce, else one derived from the ids."""
    return f"pair:{prefill_id}->{decode_id}" + (f"#{attempt}" if attempt else "")


def peer_ranks(ranks: list[rpb.RankInfo]) -> list[PeerRank]:
    """A peer group's RankInfos (rank 0 first) as the transfer agent knows them."""
    return [PeerRank(r.instance_id, endpoint_of(r)) for r in ranks]


class PeerRegistry(reg_grpc.RegistrationServicer):
    def __init__(
        self,
        local_info: Callable[[], rpb.RankInfo],
        agent: TransferAgent,
        metrics: Metrics,
        local_ranks: Callable[[], list[rpb.RankInfo]] | None = None,
    ) -> None:
        self.local_info = local_info
        self.local_ranks = local_ranks or (lambda: [local_info()])
        self.agent = agent
        self.metrics = metrics
        self.peers: dict[str, rpb.RankInfo] = {}
        self._pongs: set[asyncio.Task] = set()
        self._turns: dict[str, asyncio.Lock] = {}  # per peer: one pairing test at a time

    async def Register(self, request: reg.RegisterRequest, context) -> reg.RegisterResponse:
        local, peer = self.local_info(), request.rank_info
        if not peer.instance_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rank_info.instance_id: empty")
        if peer.instance_id == local.instance_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank_info.instance_id: {peer.instance_id!r} is this worker",
            )
        if len(request.pairing_nonce.encode()) > MAX_NONCE_BYTES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"pairing_nonce: over {MAX_NONCE_BYTES} bytes"
            )
        mismatches = check_peer(local, peer)
        if not mismatches:
            try:
                mismatches = await self._connect_and_test(local, peer, request.pairing_nonce)
            except Exception as e:  # a backend's library raises its own types besides TransferError
                why = f"test transfer failed: {type(e).__name__}: {e}"
                mismatches = [Mismatch(TRANSFER_FIELD, local.instance_id, peer.instance_id, why)]
        if mismatches:
            log.warning("refused %s as a peer: %s", peer.instance_id, format_mismatches(mismatches))
            self.metrics.registrations.labels("refused").inc()
            self.peers.pop(peer.instance_id, None)  # a peer that fails a new test is no longer one
            return reg.RegisterResponse(
                accepted=False, mismatches=mismatches_to_proto(mismatches), peer=local
            )
        self.peers[peer.instance_id] = peer
        self.metrics.registrations.labels("accepted").inc()
        return reg.RegisterResponse(accepted=True, peer=local)

    async def _connect_and_test(
        self, local: rpb.RankInfo, peer: rpb.RankInfo, attempt: str
    ) -> list[Mismatch]:
        """Connect anew and run the pairing test (the decode side: in the background, once
        its turn comes). Tests of one peer run one at a time, each side in arrival order:
        every router replica pairs the same two workers, each attempt under its own nonce."""
        turn = self._turns.setdefault(peer.instance_id, asyncio.Lock())
        if local.role != rpb.ROLE_DECODE:
            async with turn:
                await self._connect(peer)
                return await self._lead(peer, pair_nonce(local.instance_id, peer.instance_id, attempt))
        task = asyncio.ensure_future(
            self._answer_in_turn(turn, peer, pair_nonce(peer.instance_id, local.instance_id, attempt))
        )
        self._pongs.add(task)
        task.add_done_callback(self._pongs.discard)
        return []

    async def _lead(self, peer: rpb.RankInfo, nonce: str) -> list[Mismatch]:
        """Prefill side: test transfer, groups out and in, every rank checked and tested."""
        side, t = self.agent.side_channel, PAIR_TEST_TIMEOUT_S
        await side.ping(peer.instance_id, nonce, t)
        await self.agent.test_pages(peer.instance_id, nonce, lead=True)
        mine = group_to_bytes(self.local_ranks())
        await side.send_message(peer.instance_id, nonce, PairingMessage.SENDER_RANKS, mine, t)
        ranks = group_from_bytes(await side.receive_message(nonce, PairingMessage.RECEIVER_RANKS, t))
        verdict = reg.RegisterResponse.FromString(
            await side.receive_message(nonce, PairingMessage.RECEIVER_VERDICT, t)
        )
        if not verdict.accepted:  # named from the decode side: its values are "local" there
            return [
                Mismatch(m.field, m.peer_value, m.local_value, m.reason or f"refused by {peer.instance_id}")
                for m in verdict.mismatches
            ]
        mismatches = check_peer_group(self.local_ranks(), ranks) or await self._test_ranks(peer, ranks, nonce)
        final = reg.RegisterResponse(accepted=not mismatches, mismatches=mismatches_to_proto(mismatches))
        await side.send_message(
            peer.instance_id, nonce, PairingMessage.SENDER_VERDICT, final.SerializeToString(), t
        )
        if not mismatches:
            self.agent.pair(peer.instance_id, peer_ranks(ranks))
        return mismatches

    async def _test_ranks(self, peer: rpb.RankInfo, ranks: list[rpb.RankInfo], nonce: str) -> list[Mismatch]:
        """Prefill side: the test transfer of every other rank pair; a failure is a mismatch."""
        try:
            await self.agent.test_links(peer_ranks(ranks), lead=True, nonce=nonce)
        except TransferError as e:
            local = self.local_info().instance_id
            why = f"test transfer between ranks failed: {e}"
            return [Mismatch(TRANSFER_FIELD, local, peer.instance_id, why)]
        return []

    async def _connect(self, peer: rpb.RankInfo) -> None:
        """The send direction to ``peer``: kept when its address is unchanged (closing an
        endpoint breaks the peer's replies, kvcore/transfer/ucx.py), opened anew when it
        registered again at a new address (a restart)."""
        await self.agent.connect(peer.instance_id, endpoint_of(peer))

    async def _answer_in_turn(self, turn: asyncio.Lock, peer: rpb.RankInfo, nonce: str) -> None:
        async with turn:
            try:
                await self._connect(peer)
            except Exception as e:  # a backend's library raises its own types besides TransferError
                log.warning("pairing with %s failed: connect: %s: %s", peer.instance_id, type(e).__name__, e)
                self.peers.pop(peer.instance_id, None)
                return
            await self._answer(peer, nonce)

    async def _answer(self, peer: rpb.RankInfo, nonce: str) -> None:
        """Decode side: echo, check the prefill group, answer, echo every other rank pair,
        then keep or drop the peer as the prefill side decides."""
        accepted = False
        try:
            accepted = await self._answer_steps(peer, nonce)
        except Exception as e:  # a backend's library raises its own types besides TransferError
            log.warning(
                "pairing with %s failed: test transfer: %s: %s", peer.instance_id, type(e).__name__, e
            )
        finally:
            if not accepted:
                self.peers.pop(peer.instance_id, None)
                self.agent.unpair(peer.instance_id)

    async def _answer_steps(self, peer: rpb.RankInfo, nonce: str) -> bool:
        side, t = self.agent.side_channel, PAIR_TEST_TIMEOUT_S
        await side.pong(peer.instance_id, nonce, t)
        await self.agent.test_pages(peer.instance_id, nonce, lead=False)
        ranks = group_from_bytes(await side.receive_message(nonce, PairingMessage.SENDER_RANKS, t))
        mismatches = check_peer_group(self.local_ranks(), ranks)
        if not mismatches:
            self.agent.pair(peer.instance_id, peer_ranks(ranks))  # before the answer: traffic may follow
        mine = group_to_bytes(self.local_ranks())
        await side.send_message(peer.instance_id, nonce, PairingMessage.RECEIVER_RANKS, mine, t)
        verdict = reg.RegisterResponse(accepted=not mismatches, mismatches=mismatches_to_proto(mismatches))
        await side.send_message(
            peer.instance_id, nonce, PairingMessage.RECEIVER_VERDICT, verdict.SerializeToString(), t
        )
        if mismatches:
            return False
        await self.agent.test_links(peer_ranks(ranks), lead=False, nonce=nonce)
        final = reg.RegisterResponse.FromString(
            await side.receive_message(nonce, PairingMessage.SENDER_VERDICT, t)
        )
        return final.accepted

    async def Deregister(self, request, context) -> reg.DeregisterResponse:
        removed = self.peers.pop(request.instance_id, None) is not None
        await self.agent.disconnect(request.instance_id)
        return reg.DeregisterResponse(removed=removed)

    async def ListPeers(self, request, context) -> reg.ListPeersResponse:
        return reg.ListPeersResponse(
            peers=[p for p in self.peers.values() if request.role in (rpb.ROLE_UNSPECIFIED, p.role)]
        )

    async def Heartbeat(self, request, context) -> reg.HeartbeatResponse:
        return reg.HeartbeatResponse(registered=request.instance_id in self.peers)
