"""A worker's registration with every router replica it is pointed at.

``--router`` lists routers as ``host:port`` separated by commas; a host name stands for
every address it resolves to (a Kubernetes headless Service: one per router pod), looked up
again every RESOLVE_INTERVAL_S, so router pods that come later are registered with too.
Each router gets its own loop: register, heartbeat every HEARTBEAT_S, register again when
that router forgets the worker (its heartbeat says so, or it restarted). A refusal (the
router's contract or a credential) is printed once per distinct reason, and retried.
On shutdown (services/worker/shutdown.py) the loops stop first, then ``deregister`` tells
every router, drain first (no new requests) and gone last.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import sys
from collections.abc import Awaitable, Callable

import grpc

from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from services.common.security import TlsConfig, aio_channel

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
DEREGISTER_TIMEOUT_S = 2.0  # a router that does not answer by then is left to notice the worker gone
RESOLVE_INTERVAL_S = 5.0
CALL_TIMEOUT_S = 5.0
RECONNECT = [("grpc.max_reconnect_backoff_ms", 1000)]
"""A router that comes back is found within a second (grpc's backoff would grow to 120 s)."""
REFUSALS = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.INVALID_ARGUMENT,
)
"""Registration answers that a retry alone will not change: printed for the operator."""


async def router_addresses(spec: str) -> list[str]:
    """Every ``host:port`` of ``spec`` (comma-separated), host names resolved to each of
    their addresses (off the event loop); a name that does not resolve (yet) is kept as it is."""
    addresses: list[str] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        host, _, port = item.rpartition(":")
        for address in await _resolved(host, port):
            if address not in addresses:
                addresses.append(address)
    return addresses


async def _resolved(host: str, port: str) -> list[str]:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return [f"{host}:{port}"]
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return [f"{host}:{port}"]
    ips = sorted({info[4][0] for info in infos})
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


class RouterLinks:
    """The worker's registrations, one loop per router address; ``registered`` holds the
    routers that know the worker now."""

    def __init__(
        self,
        spec: str,
        rank_info: Callable[[], rpb.RankInfo],
        tls: TlsConfig | None,
        token: str,
    ) -> None:
        """``rank_info``: the worker's, as it registers; ``token``: its own (security.py)."""
        self.spec, self.rank_info, self.tls, self.token = spec, rank_info, tls, token
        self.instance_id = rank_info().instance_id
        self.registered: set[str] = set()
        self.known: set[str] = set()  # every router address registered with at some time
        self._loops: dict[str, asyncio.Task] = {}

    async def deregister(self, draining: bool) -> None:
        """Tell every router this worker registered with that it leaves: ``draining`` = it
        gets no new requests but finishes those in flight; else it is gone. Stop ``run``
        first, or its heartbeats register it again. A router that does not answer within
        DEREGISTER_TIMEOUT_S is logged and skipped."""
        await asyncio.gather(*(self._deregister(a, draining) for a in sorted(self.known)))

    async def _deregister(self, address: str, draining: bool) -> None:
        try:
            async with aio_channel(address, self.tls, self.token) as channel:
                await reg_grpc.RegistrationStub(channel).Deregister(
                    reg.DeregisterRequest(instance_id=self.instance_id, draining=draining),
                    timeout=DEREGISTER_TIMEOUT_S,
                )
        except grpc.aio.AioRpcError as e:
            what = "draining" if draining else "deregistration"
            if e.code() == grpc.StatusCode.UNAVAILABLE:  # that router is gone: nothing to tell
                log.info("router %s is gone; nothing to tell it", address)
                self.known.discard(address)
                return
            log.warning(
                "router %s did not take this worker's %s: %s: %s", address, what, e.code().name, e.details()
            )

    async def run(self, changed: Callable[[], Awaitable[None]]) -> None:
        """Keep a loop per resolved router address, forever; ``changed()`` after each round
        of heartbeats (the caller reports readiness from ``registered``)."""
        try:
            while True:
                for address in await router_addresses(self.spec):
                    if address not in self._loops:
                        self._loops[address] = asyncio.ensure_future(self._register_forever(address, changed))
                await asyncio.sleep(RESOLVE_INTERVAL_S)
        finally:
            for task in self._loops.values():
                task.cancel()

    async def _register_forever(self, address: str, changed: Callable[[], Awaitable[None]]) -> None:
        async with aio_channel(address, self.tls, self.token, RECONNECT) as channel:
            stub = reg_grpc.RegistrationStub(channel)
            known, refusal = False, ""
            while True:
                try:
                    if not known:
                        answer = await stub.Register(
                            reg.RegisterRequest(rank_info=self.rank_info()), timeout=CALL_TIMEOUT_S
                        )
                        known = answer.accepted
                        if not known:
                            refusal = _note(address, refusal, _describe(answer))
                    if known:
                        beat = await stub.Heartbeat(
                            reg.HeartbeatRequest(instance_id=self.instance_id),
                            timeout=CALL_TIMEOUT_S,
                        )
                        known = beat.registered
                except grpc.aio.AioRpcError as e:
                    known = False
                    if e.code() in REFUSALS:
                        refusal = _note(address, refusal, f"{e.code().name}: {e.details()}")
                (self.registered.add if known else self.registered.discard)(address)
                if known:
                    self.known.add(address)
                await changed()
                await asyncio.sleep(HEARTBEAT_S)


def _describe(answer: reg.RegisterResponse) -> str:
    return "refused: " + "; ".join(
        f"{m.field}: router {m.local_value}, this worker {m.peer_value}" for m in answer.mismatches
    )


def _note(address: str, last: str, reason: str) -> str:
    """Print ``reason`` unless it is ``last``; returns it."""
    if reason != last:
        print(
            f"tandem: the router at {address} did not register this worker: {reason}",
            file=sys.stderr,
            flush=True,
        )
    return reason
