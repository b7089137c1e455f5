"""Workers joining and leaving the router, and every new prefill/decode pair tested.

A pair is tested in the background as soon as both of its workers are registered:
1. the decode worker checks the prefill worker's RankInfo (its ``Register``: the transfer
   backend too), connects its transport to it (for acknowledgements) and waits for the test
   transfer;
2. the prefill worker checks the decode worker's RankInfo, connects, and runs the test
   transfer (a 64 KiB buffer sent and echoed over the transport, UCX).

Invariants:
- A registration is refused (RouterError) before anything changes: an empty instance id,
  role or gRPC address, in that order; then an identity that may not take the instance id
  (``check_identity``). Credentials were checked before (services/common/access.py).
- A worker whose RankInfo breaks the router's model contract (``check_contract``: model,
  page size, schema) is answered ``accepted: false`` naming each field, the router's value
  as ``local_value``; it is not registered. ROLE_BOTH workers are checked alike.
- Heartbeat and Deregister of a registered instance id need the identity it registered with.
- A mismatch on either side refuses the pair, naming the field and both values; the pair
  is READY only when both accepted and the test transfer came back intact.
- ``tandem_registrations_total{result}`` counts each accepted worker and each pair's
  outcome ("accepted" when READY, else "refused").
"""

from __future__ import annotations

import logging
import secrets

import grpc

from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from services.common.metrics import Metrics
from services.common.peer_check import TRANSFER_FIELD, check_contract, format_mismatches, mismatches_to_proto
from services.router.cluster import Cluster
from services.router.errors import ErrorCode, RouterError
from services.router.registry import PairState, Worker

PAIR_TIMEOUT_S = 30.0
CONFIRM_TIMEOUT_S = 5.0  # a live worker's answer to the Stats that confirms its re-registration
HEARTBEAT_INTERVAL_MS = 1000
log = logging.getLogger(__name__)


class Registration:
    def __init__(self, cluster: Cluster, metrics: Metrics, contract: rpb.RankInfo | None = None) -> None:
        """``contract``: the RankInfo fields every worker must match (unset ones: any)."""
        self.cluster = cluster
        self.registry = cluster.registry
        self.metrics = metrics
        self.contract = contract or rpb.RankInfo()

    async def register(self, request: reg.RegisterRequest, identity: str = "") -> reg.RegisterResponse:
        """Accept a worker (again, if it was known) and start testing its new pairs;
        ``identity``: the caller's (services/common/access.py)."""
        info = request.rank_info
        try:
            _check_registration(request)
            registered = self.registry.workers.get(info.instance_id)
            check_identity(info, identity, registered)
            await self._confirm_live(info, registered)
        except RouterError as e:
            log.warning("refused the registration of %r from %s: %s", info.instance_id, info.grpc_address, e)
            raise
        mismatches = check_contract(self.contract, info)
        if mismatches:
            log.warning("refused worker %s: %s", info.instance_id, format_mismatches(mismatches))
            self.metrics.registrations.labels("refused").inc()
            return reg.RegisterResponse(accepted=False, mismatches=mismatches_to_proto(mismatches))
        await self.cluster.connect(info)
        for prefill_id, decode_id in self.registry.add(info, identity):
            self.cluster.spawn(self.pair(prefill_id, decode_id))
        self.metrics.registrations.labels("accepted").inc()
        return reg.RegisterResponse(accepted=True)

    async def _confirm_live(self, info: rpb.RankInfo, registered: Worker | None) -> None:
        """A live worker registered again (at its own address: ``check_identity``): the
        process at that address must report this very RankInfo (a restart does; a second
        caller with the same identity, or none, cannot replace a live worker's transfer endpoint
        or geometry). RouterError otherwise, naming what differs."""
        if registered is None or not registered.healthy or info.instance_id not in self.cluster.channels:
            return
        if registered.info == info:  # the same registration again: nothing changes
            return
        where = f"the live worker {info.instance_id!r} at {info.grpc_address}"
        try:
            stats = await self.cluster.stats_stub(registered).Stats(
                wpb.StatsRequest(), timeout=CONFIRM_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as e:
            raise RouterError(
                ErrorCode.UNAVAILABLE,
                f"rank_info: {where} did not confirm it ({e.code().name}: {e.details()})",
            ) from None
        if stats.rank_info != info:
            fields = [
                f.name
                for f in rpb.RankInfo.DESCRIPTOR.fields
                if getattr(stats.rank_info, f.name) != getattr(info, f.name)
            ]
            raise RouterError(
                ErrorCode.PERMISSION_DENIED,
                f"rank_info: {', '.join(fields)} differ from what {where} reports",
            )

    async def deregister(self, instance_id: str, identity: str = "", draining: bool = False) -> bool:
        """Forget a worker and its pairs; True if it was registered. ``draining``: it is
        shutting down: keep it (and its channel, for the requests in flight there) but send
        it no new request; it deregisters again, not draining, when it exits."""
        self._check_caller(instance_id, identity)
        if draining:
            worker = self.registry.workers.get(instance_id)
            if worker is not None and not worker.draining:
                worker.draining = True
                log.info("worker %s is draining: no new requests go to it", instance_id)
            return worker is not None
        removed = self.registry.remove(instance_id)
        await self.cluster.disconnect(instance_id)
        return removed

    def list_peers(self, role: int) -> list[rpb.RankInfo]:
        """The registered workers of ``role`` (ROLE_UNSPECIFIED: all)."""
        workers = self.registry.workers.values()
        return [w.info for w in workers if role in (rpb.ROLE_UNSPECIFIED, w.role)]

    def heartbeat(self, instance_id: str, identity: str = "") -> reg.HeartbeatResponse:
        """``registered`` False tells a forgotten worker to register again."""
        self._check_caller(instance_id, identity)
        known = instance_id in self.registry.workers
        return reg.HeartbeatResponse(registered=known, interval_ms=HEARTBEAT_INTERVAL_MS)

    def _check_caller(self, instance_id: str, identity: str) -> None:
        worker = self.registry.workers.get(instance_id)
        if worker is not None and worker.identity != identity:
            raise RouterError(
                ErrorCode.PERMISSION_DENIED, f"instance_id: {instance_id!r} has another credential"
            )

    async def pair(self, prefill_id: str, decode_id: str) -> None:
        """Test one pair and record its state (if both workers are still registered)."""
        workers = self.registry.workers
        if prefill_id not in workers or decode_id not in workers:
            return
        prefill, decode = workers[prefill_id].info, workers[decode_id].info
        state, reason = await pair_workers(self.cluster.channels, prefill, decode)
        self.registry.set_pair(prefill_id, decode_id, state, reason)
        self.metrics.registrations.labels("accepted" if state == PairState.READY else "refused").inc()

    async def heal(self, prefill_id: str, decode_id: str) -> bool:
        """Re-run a DEGRADED or FAILED pair's pairing (both workers reconnect and test the
        transfer again): READY if it passes; else it keeps its state (REFUSED if a RankInfo
        now differs), the first failure and the latest attempt's as its reason."""
        workers, key = self.registry.workers, (prefill_id, decode_id)
        if prefill_id not in workers or decode_id not in workers:
            return False
        pair = self.registry.pairs.get(key)
        first = pair.reason.split("; re-pairing: ")[0] if pair is not None else ""  # what broke it
        prefill, decode = workers[prefill_id].info, workers[decode_id].info
        state, reason = await pair_workers(self.cluster.channels, prefill, decode)
        now = self.registry.pairs.get(key)
        if now is not pair:  # re-registered, removed or changed meanwhile
            return False
        healed = state == PairState.READY
        again = f"{first}; re-pairing: {reason}" if first else f"re-pairing: {reason}"
        self.registry.set_pair(prefill_id, decode_id, state, "" if healed else again)
        self.metrics.registrations.labels("healed" if healed else "refused").inc()
        return healed


def _check_registration(request: reg.RegisterRequest) -> None:
    info = request.rank_info
    if not info.instance_id:
        raise RouterError(ErrorCode.INVALID_ARGUMENT, "rank_info.instance_id: empty")
    if info.role == rpb.ROLE_UNSPECIFIED:
        raise RouterError(ErrorCode.INVALID_ARGUMENT, "rank_info.role: unspecified")
    if not info.grpc_address:
        raise RouterError(ErrorCode.INVALID_ARGUMENT, "rank_info.grpc_address: empty")


def check_identity(info: rpb.RankInfo, identity: str, registered: Worker | None) -> None:
    """May ``identity`` register ``info``? A worker token names its one instance id; a live
    worker is replaced only by its own identity at its own address (a restart): another
    identity, or a second process under the same id, waits until the old one is lost."""
    named = identity.removeprefix("worker:") if identity.startswith("worker:") else None
    if named is not None and named != info.instance_id:
        raise RouterError(
            ErrorCode.PERMISSION_DENIED,
            f"rank_info.instance_id: {info.instance_id!r} is not this credential's ({named!r})",
        )
    if registered is None or not registered.healthy:
        return
    if registered.identity != identity:
        raise RouterError(
            ErrorCode.PERMISSION_DENIED,
            f"rank_info.instance_id: {info.instance_id!r} is a live worker's with another credential",
        )
    if registered.info.grpc_address != info.grpc_address:
        raise RouterError(
            ErrorCode.ALREADY_EXISTS,
            f"rank_info.instance_id: {info.instance_id!r} is registered to a live worker at "
            f"{registered.info.grpc_address} (this one: {info.grpc_address}); give each worker its own id",
        )


async def pair_workers(
    channels: dict[str, grpc.aio.Channel], prefill: rpb.RankInfo, decode: rpb.RankInfo
) -> tuple[PairState, str]:
    """Run both registrations, decode side first, under a fresh pairing nonce. Returns the
    pair's state and why: FAILED for a transient failure (an RPC, the test transfer: the
    ``transfer_endpoint`` field), REFUSED for a RankInfo mismatch (another transfer backend
    included)."""
    steps = ((decode, prefill), (prefill, decode))  # (who checks, whose info)
    nonce = secrets.token_hex(8)
    for checker, peer in steps:
        stub = reg_grpc.RegistrationStub(channels[checker.instance_id])
        request = reg.RegisterRequest(rank_info=peer, pairing_nonce=nonce)
        try:
            response = await stub.Register(request, timeout=PAIR_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            return PairState.FAILED, f"{checker.instance_id}: {e.code().name}: {e.details()}"
        if not response.accepted:
            transient = all(m.field == TRANSFER_FIELD for m in response.mismatches)
            mismatches = describe_mismatches(response)
            state = PairState.FAILED if transient else PairState.REFUSED
            return state, f"{checker.instance_id} refused {peer.instance_id}: {mismatches}"
    return PairState.READY, ""


def describe_mismatches(response: reg.RegisterResponse) -> str:
    return "; ".join(
        f"{m.field}: local {m.local_value} vs peer {m.peer_value}" + (f" ({m.reason})" if m.reason else "")
        for m in response.mismatches
    )
