"""A worker's side of pairing (the Registration service every worker serves).

``Register(rank_info = peer)`` asks this worker to pair with ``peer``: it checks the
peer's RankInfo against its own (``check_peer``), connects its UCX endpoint to the peer,
and runs its half of the test transfer: a decode worker starts echoing, a prefill worker
sends and waits for the echo. Only then is the peer accepted and may take traffic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from kvcore.transfer.kv_transfer import KVTransferAgent
from kvcore.transfer.ucx import TransferError, UcxEndpointInfo
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from services.common.metrics import Metrics
from services.common.peer_check import check_peer, mismatches_to_proto

PAIR_TEST_TIMEOUT_S = 10.0


def pair_nonce(prefill_id: str, decode_id: str) -> str:
    return f"pair:{prefill_id}->{decode_id}"


class PeerRegistry(reg_grpc.RegistrationServicer):
    def __init__(self, local_info: Callable[[], rpb.RankInfo], agent: KVTransferAgent,
                 metrics: Metrics, token: str = "") -> None:
        self.local_info = local_info
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
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"rank_info.instance_id: {peer.instance_id!r} is this worker")
        mismatches = check_peer(local, peer)
        if mismatches:
            self.metrics.registrations.labels("refused").inc()
            return reg.RegisterResponse(accepted=False, mismatches=mismatches_to_proto(mismatches),
                                        peer=local)
        try:
            await self._connect_and_test(local, peer)
        except (TransferError, ValueError) as e:
            self.metrics.registrations.labels("refused").inc()
            return reg.RegisterResponse(accepted=False, peer=local, mismatches=[reg.Mismatch(
                field="ucx", local_value=local.instance_id, peer_value=peer.instance_id,
                reason=f"test transfer failed: {e}")])
        self.peers[peer.instance_id] = peer
        self.metrics.registrations.labels("accepted").inc()
        return reg.RegisterResponse(accepted=True, peer=local)

    async def _connect_and_test(self, local: rpb.RankInfo, peer: rpb.RankInfo) -> None:
        await self.agent.disconnect(peer.instance_id)  # a re-registering peer has a new address
        await self.agent.connect(peer.instance_id, UcxEndpointInfo(
            peer.ucx.worker_address, peer.ucx.host, peer.ucx.port))
        if local.role == rpb.ROLE_DECODE:
            nonce = pair_nonce(peer.instance_id, local.instance_id)
            task = asyncio.ensure_future(self.agent.pong(peer.instance_id, nonce,
                                                         PAIR_TEST_TIMEOUT_S))
            self._pongs.add(task)
            task.add_done_callback(self._pongs.discard)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        else:
            nonce = pair_nonce(local.instance_id, peer.instance_id)
            await self.agent.ping(peer.instance_id, nonce, PAIR_TEST_TIMEOUT_S)

    async def Deregister(self, request, context) -> reg.DeregisterResponse:
        removed = self.peers.pop(request.instance_id, None) is not None
        await self.agent.disconnect(request.instance_id)
        return reg.DeregisterResponse(removed=removed)

    async def ListPeers(self, request, context) -> reg.ListPeersResponse:
        return reg.ListPeersResponse(peers=[p for p in self.peers.values()
                                            if request.role in (rpb.ROLE_UNSPECIFIED, p.role)])

    async def Heartbeat(self, request, context) -> reg.HeartbeatResponse:
        return reg.HeartbeatResponse(registered=request.instance_id in self.peers)
