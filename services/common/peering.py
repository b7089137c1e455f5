"""A worker's side of pairing (the Registration service every worker serves).

``Register(rank_info = peer)`` asks this worker to pair with ``peer``: it checks the
peer's RankInfo against its own (``check_peer``), connects its UCX endpoint to the peer,
and runs its half of the test transfer: a decode worker starts echoing, a prefill worker
sends and waits for the echo. Then the two rank-0s exchange their groups' RankInfos
(every tensor-parallel rank's) and check them all (services/common/tp_check.py): the
decode side answers with its group and its verdict, the prefill side checks too, tests
every other rank pair that will exchange pages, and tells the decode side the outcome.
Only then is the peer accepted and may take traffic; a refusal names every mismatch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from kvcore.transfer.ucx import TransferError, UcxEndpointInfo
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from services.common.metrics import Metrics
from services.common.peer_check import Mismatch, check_peer, mismatches_to_proto
from services.common.tp_check import check_peer_group, group_from_bytes, group_to_bytes
from services.common.tp_control import RankError
from services.common.tp_group import GroupTransferAgent

PAIR_TEST_TIMEOUT_S = 10.0
GROUP_CHUNK = 2  # the prefill side's ranks (length, then bytes: chunks 2 and 3)
PEER_GROUP_CHUNK = 4  # the decode side's ranks
VERDICT_CHUNK = 6  # the decode side's RegisterResponse
FINAL_CHUNK = 8  # the prefill side's RegisterResponse (sent when the decode side accepted)


def pair_nonce(prefill_id: str, decode_id: str) -> str:
    return f"pair:{prefill_id}->{decode_id}"


class PeerRegistry(reg_grpc.RegistrationServicer):
    def __init__(
        self,
        local_info: Callable[[], rpb.RankInfo],
        agent: GroupTransferAgent,
        metrics: Metrics,
        token: str = "",
        local_ranks: Callable[[], list[rpb.RankInfo]] | None = None,
    ) -> None:
        self.local_info = local_info
        self.local_ranks = local_ranks or (lambda: [local_info()])
        self.agent = agent
        self.metrics = metrics
        self.token = token
        self.peers: dict[str, rpb.RankInfo] = {}
        self._pongs: set[asyncio.Task] = set()

    async def Register(self, request: reg.RegisterRequest, context) -> reg.RegisterResponse:
        if self.token and request.token != self.token:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "token: does not match")
        local, peer = self.local_info(), request.rank_info
        if not peer.instance_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rank_info.instance_id: empty")
        if peer.instance_id == local.instance_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank_info.instance_id: {peer.instance_id!r} is this worker",
            )
        mismatches = check_peer(local, peer)
        if not mismatches:
            try:
                mismatches = await self._connect_and_test(local, peer)
            except (TransferError, RankError, ValueError) as e:
                mismatches = [
                    Mismatch("ucx", local.instance_id, peer.instance_id, f"test transfer failed: {e}")
                ]
        if mismatches:
            self.metrics.registrations.labels("refused").inc()
            return reg.RegisterResponse(
                accepted=False, mismatches=mismatches_to_proto(mismatches), peer=local
            )
        self.peers[peer.instance_id] = peer
        self.metrics.registrations.labels("accepted").inc()
        return reg.RegisterResponse(accepted=True, peer=local)

    async def _connect_and_test(self, local: rpb.RankInfo, peer: rpb.RankInfo) -> list[Mismatch]:
        await self.agent.disconnect(peer.instance_id)  # a re-registering peer has a new address
        await self.agent.connect(
            peer.instance_id, UcxEndpointInfo(peer.ucx.worker_address, peer.ucx.host, peer.ucx.port)
        )
        if local.role != rpb.ROLE_DECODE:
            return await self._lead(peer, pair_nonce(local.instance_id, peer.instance_id))
        task = asyncio.ensure_future(self._answer(peer, pair_nonce(peer.instance_id, local.instance_id)))
        self._pongs.add(task)
        task.add_done_callback(self._pongs.discard)
        return []

    async def _lead(self, peer: rpb.RankInfo, nonce: str) -> list[Mismatch]:
        """Prefill side: test transfer, groups out and in, every rank checked and tested."""
        a, t = self.agent, PAIR_TEST_TIMEOUT_S
        await a.ping(peer.instance_id, nonce, t)
        await a.send_message(peer.instance_id, nonce, GROUP_CHUNK, group_to_bytes(self.local_ranks()), t)
        ranks = group_from_bytes(await a.receive_message(nonce, PEER_GROUP_CHUNK, t))
        verdict = reg.RegisterResponse.FromString(await a.receive_message(nonce, VERDICT_CHUNK, t))
        if not verdict.accepted:  # named from the decode side: its values are "local" there
            return [
                Mismatch(m.field, m.peer_value, m.local_value, m.reason or f"refused by {peer.instance_id}")
                for m in verdict.mismatches
            ]
        mismatches = check_peer_group(self.local_ranks(), ranks)
        if not mismatches:
            try:
                await a.test_links(ranks, sender=True, nonce=nonce)
            except TransferError as e:
                mismatches = [
                    Mismatch(
                        "ucx",
                        self.local_info().instance_id,
                        peer.instance_id,
                        f"test transfer between ranks failed: {e}",
                    )
                ]
        final = reg.RegisterResponse(accepted=not mismatches, mismatches=mismatches_to_proto(mismatches))
        await a.send_message(peer.instance_id, nonce, FINAL_CHUNK, final.SerializeToString(), t)
        if not mismatches:
            a.peer_ranks[peer.instance_id] = ranks
        return mismatches

    async def _answer(self, peer: rpb.RankInfo, nonce: str) -> None:
        """Decode side: echo, check the prefill group, answer, echo every other rank pair,
        then keep or drop the peer as the prefill side decides."""
        a, t = self.agent, PAIR_TEST_TIMEOUT_S
        accepted = False
        try:
            await a.pong(peer.instance_id, nonce, t)
            ranks = group_from_bytes(await a.receive_message(nonce, GROUP_CHUNK, t))
            mismatches = check_peer_group(self.local_ranks(), ranks)
            if not mismatches:
                a.peer_ranks[peer.instance_id] = ranks  # before the answer: traffic may follow
            await a.send_message(
                peer.instance_id, nonce, PEER_GROUP_CHUNK, group_to_bytes(self.local_ranks()), t
            )
            verdict = reg.RegisterResponse(
                accepted=not mismatches, mismatches=mismatches_to_proto(mismatches)
            )
            await a.send_message(peer.instance_id, nonce, VERDICT_CHUNK, verdict.SerializeToString(), t)
            if mismatches:
                return
            await a.test_links(ranks, sender=False, nonce=nonce)
            final = reg.RegisterResponse.FromString(await a.receive_message(nonce, FINAL_CHUNK, t))
            accepted = final.accepted
        except (TransferError, RankError):
            pass
        finally:
            if not accepted:
                self.peers.pop(peer.instance_id, None)
                a.peer_ranks.pop(peer.instance_id, None)

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
