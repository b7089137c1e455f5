"""The router's health polls: who is lost and when, what is cancelled, readiness (no worker
processes: workers are addresses nobody listens on, or a gRPC server without the worker API)."""

from __future__ import annotations

import asyncio

import pytest
from grpc_health.v1 import health, health_pb2

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import worker_pb2 as wpb
from services.common.grpc_server import READY_SERVICE, start_server
from services.router.dispatch import RequestFlow
from tests.services.router.helpers import rank_info, router, unreachable_ready_pairs


def _flow(api, rid: str, workers: tuple[str, ...], call) -> RequestFlow:
    flow = RequestFlow(rid, [1, 2], cpb.GenerateRequest(), None, api.cluster, api.metrics)
    flow.workers, flow.call = workers, call
    api.flows[rid] = flow
    return flow


async def _readiness(servicer: health.aio.HealthServicer) -> int:
    return (await servicer.Check(health_pb2.HealthCheckRequest(service=READY_SERVICE), None)).status


def test_a_refused_connection_loses_the_worker_at_once_and_cancels_the_calls_on_it():
    api = router()
    monitor = api.health_monitor
    monitor.readiness = health.aio.HealthServicer()

    async def scenario():
        await unreachable_ready_pairs(api, ["p0"], ["d0"])
        serving_before = api.cluster.registry.is_serving()
        pending = api.cluster.decode_stub("d0").Stats(wpb.StatsRequest(), wait_for_ready=True, timeout=30)
        on_d0 = _flow(api, "a", ("d0",), pending)  # as a Decode call
        elsewhere = _flow(api, "b", ("p1",), None)
        await monitor.poll()
        with pytest.raises(asyncio.CancelledError):
            await pending
        ready = await _readiness(monitor.readiness)
        await api.close()
        return serving_before, on_d0, elsewhere, ready

    serving_before, on_d0, elsewhere, ready = asyncio.run(scenario())
    workers = api.cluster.registry.workers
    assert serving_before and ready == health_pb2.HealthCheckResponse.NOT_SERVING
    assert [(w.healthy, w.missed) for w in workers.values()] == [(False, 1), (False, 1)]
    assert (on_d0.lost, elsewhere.lost) == ("d0", "")
    assert not api.cluster.registry.is_serving()


def test_unanswered_polls_lose_a_worker_only_after_the_allowed_misses():
    api = router()
    api.health_monitor.misses = 3

    async def scenario():
        server, _, port = await start_server(lambda s: None, "127.0.0.1", 0)  # no worker API
        info = rank_info("d0", rpb.ROLE_DECODE, f"127.0.0.1:{port}")
        await api.registration.register(reg.RegisterRequest(rank_info=info))
        seen = []
        for _ in range(4):
            await api.health_monitor.poll()
            worker = api.cluster.registry.workers["d0"]
            seen.append((worker.healthy, worker.missed))
        await api.close()
        await server.stop(None)
        return seen

    assert asyncio.run(scenario()) == [(True, 1), (True, 2), (False, 3), (False, 4)]
