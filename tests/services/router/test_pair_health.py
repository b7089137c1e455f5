"""Degraded pairs: a failed transfer takes its pair out of service, Health says so, the
request is retried on another pair, and re-pairing brings the pair back or keeps it out."""

from __future__ import annotations

import asyncio

import grpc

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import worker_pb2 as wpb
from services.router.cluster import Cluster
from services.router.health import HealthMonitor, health_response
from services.router.registry import PairState, Registry
from tests.services.router.helpers import (
    StreamCall,
    prefill_answer,
    rank_info,
    router,
    unreachable_ready_pairs,
)

PROMPT = [5, 6, 7, 8, 9]
TRANSFER_FAILED = "transfer failed to d0: send of tag 0x1 to 'd0' not taken within 1.0 s"


def _registry(*pairs: tuple[str, str]) -> Registry:
    registry = Registry(4)
    for p, d in pairs:
        for worker_id, role in ((d, rpb.ROLE_DECODE), (p, rpb.ROLE_PREFILL)):
            if worker_id not in registry.workers:
                registry.add(rank_info(worker_id, role, "127.0.0.1:1"))
    for p, d in pairs:
        registry.set_pair(p, d, PairState.READY)
    return registry


def test_a_degraded_pair_is_not_ready_and_health_names_its_reason():
    registry = _registry(("p0", "d0"), ("p1", "d0"))
    assert registry.degrade("p0", "d0", "p0: transfer failed") is True
    assert registry.degrade("p0", "d0", "again") is False  # only a READY pair degrades
    health = health_response(registry)
    assert (health.status, health.num_ready_pairs) == (cpb.SERVING_STATUS_SERVING, 1)
    why = "p0: transfer failed (failures in a row: 1; re-pairing every 0.5 s)"
    assert health.message == f"p0->d0: degraded: {why}"
    assert registry.ready_pairs() == [("p1", "d0")]
    assert [(s.prefill_instance_id, s.state, s.reason) for s in health.pairs] == [
        ("p0", "degraded", why),
        ("p1", "ready", ""),
    ]
    registry.degrade("p1", "d0", "p1: transfer failed")
    health = health_response(registry)
    assert (health.status, health.num_ready_pairs) == (cpb.SERVING_STATUS_NOT_SERVING, 0)
    assert health.message.startswith("no ready prefill/decode pair. p0->d0: degraded: ")


class _Call:
    """An awaitable stand-in for a unary gRPC call."""

    def __init__(self, result=None, error: grpc.aio.AioRpcError | None = None) -> None:
        self.result, self.error = result, error

    def cancel(self) -> None:
        pass

    def __await__(self):
        if self.error is not None:
            raise self.error
        return self.result
        yield  # a generator, so the call can be awaited


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )


class _Stubs:
    """Decode stubs that reserve; prefill stubs whose first Prefill fails its transfer."""

    def __init__(self) -> None:
        self.prefills: list[str] = []

    def decode(self, worker_id: str):
        reservation = wpb.Reservation(request_id="r", decode_instance_id=worker_id)
        stub = type("Decode", (), {})()
        stub.Reserve = lambda request, timeout: _Call(wpb.ReserveResponse(reservation=reservation))
        stub.Release = lambda request, timeout: _Call(wpb.ReleaseResponse(released=True))
        return stub

    def prefill(self, worker_id: str):
        stub = type("Prefill", (), {})()
        stub.Prefill = lambda request, timeout: self._prefill(worker_id)
        return stub

    def _prefill(self, worker_id: str) -> StreamCall:
        self.prefills.append(worker_id)
        if len(self.prefills) == 1:
            return StreamCall([_unavailable(TRANSFER_FAILED)])
        return prefill_answer(finish_reason=cpb.FINISH_REASON_LENGTH)


def _request() -> cpb.GenerateRequest:
    sampling = cpb.SamplingParams(max_tokens=1)
    return cpb.GenerateRequest(request_id="r", token_ids=cpb.TokenIds(ids=PROMPT), sampling=sampling)


async def _generate(api, max_tokens: int) -> list[cpb.GenerateResponse]:
    """One request's messages, then the router closed."""
    request = _request()
    request.sampling.max_tokens = max_tokens
    messages = [m async for m in api.generate(request)]
    await api.close()
    return messages


def test_a_failed_transfer_degrades_its_pair_and_the_request_completes_on_another():
    api, stubs = router(), _Stubs()

    async def scenario():
        await unreachable_ready_pairs(api, ["p0", "p1"], ["d0"])
        api.cluster.decode_stub, api.cluster.prefill_stub = stubs.decode, stubs.prefill
        messages = [m async for m in api.generate(_request())]
        await api.close()
        return messages

    messages = asyncio.run(scenario())
    first, other = stubs.prefills
    assert first != other
    assert [m.WhichOneof("payload") for m in messages] == ["chunk", "complete"]
    assert messages[-1].complete.finish_reason == cpb.FINISH_REASON_LENGTH
    pair = api.cluster.registry.pairs[(first, "d0")]
    assert (pair.state, pair.reason) == (PairState.DEGRADED, f"{first}: {TRANSFER_FAILED}")
    assert api.cluster.registry.pairs[(other, "d0")].state == PairState.READY


def test_re_pairing_that_fails_keeps_the_pair_degraded_with_both_reasons():
    api = router()

    async def scenario():
        await unreachable_ready_pairs(api, ["p0"], ["d0"])
        api.cluster.registry.degrade("p0", "d0", "p0: transfer failed")
        healed = await api.registration.heal("p0", "d0")
        again = await api.registration.heal("p0", "d0")
        await api.close()
        return healed, again

    assert asyncio.run(scenario()) == (False, False)
    pair = api.cluster.registry.pairs[("p0", "d0")]
    assert pair.state == PairState.DEGRADED
    assert pair.reason.startswith("p0: transfer failed; re-pairing: d0: UNAVAILABLE: ")
    assert pair.reason.count("re-pairing") == 1  # the failure and the latest attempt only
    (status,) = asyncio.run(api.model_info()).pairs
    assert (status.decode_instance_id, status.state, status.reason) == ("d0", "degraded", pair.describe())
    # its first pairing (unreachable), the failed transfer and two re-pairings: no request moved since
    assert status.reason.endswith("(failures in a row: 4; re-pairing every 4.0 s)")


def test_health_counts_only_the_workers_it_has_not_lost():
    registry = _registry(("p0", "d0"), ("p1", "d0"))
    registry.workers["p1"].healthy = False
    health = health_response(registry)
    assert (health.num_prefill_workers, health.num_decode_workers, health.num_ready_pairs) == (1, 1, 1)
    registry.workers["d0"].healthy = False
    health = health_response(registry)
    assert (health.num_prefill_workers, health.num_decode_workers, health.num_ready_pairs) == (1, 0, 0)


def test_a_failed_pairing_is_retried_after_its_delay_like_a_degraded_pair():
    """A pair whose pairing failed (a worker briefly unresponsive) stayed FAILED until a
    worker registered again, while its heartbeats said 'registered'; now it is re-paired."""
    registry = _registry(("p0", "d0"))
    registry.set_pair("p0", "d0", PairState.FAILED, "p0: DEADLINE_EXCEEDED")
    healed: list[tuple[str, str]] = []

    async def heal(p: str, d: str) -> bool:
        healed.append((p, d))
        registry.set_pair(p, d, PairState.READY)
        return True

    async def scenario():
        cluster = Cluster(registry)
        monitor = HealthMonitor(cluster, {}, heal=heal)
        monitor._retry_pairs()  # not yet: its 0.5 s delay runs from the failure
        await asyncio.sleep(0)
        first = list(healed)
        await asyncio.sleep(0.6)
        monitor._retry_pairs()
        await asyncio.sleep(0.05)
        return first

    assert asyncio.run(scenario()) == []
    assert healed == [("p0", "d0")] and registry.pairs[("p0", "d0")].state == PairState.READY


class _FailAfterFirstToken(_Stubs):
    """The first Prefill sends its first token, then fails its transfer; the retry answers
    with the token it is told to keep; Decode sends one more token."""

    def __init__(self) -> None:
        super().__init__()
        self.forced: list[int | None] = []
        self.decoded_after: list[int] = []

    def decode(self, worker_id: str):
        stub = super().decode(worker_id)
        stub.Decode = lambda request, metadata=None: self._decode(request)
        return stub

    def prefill(self, worker_id: str):
        stub = type("Prefill", (), {})()
        stub.Prefill = lambda request, timeout: self._prefill_told(worker_id, request)
        return stub

    def _prefill_told(self, worker_id: str, request: wpb.PrefillRequest) -> StreamCall:
        self.prefills.append(worker_id)
        self.forced.append(request.first_token_id if request.HasField("first_token_id") else None)
        if len(self.prefills) == 1:
            return StreamCall([wpb.PrefillResponse(first_token_id=7), _unavailable(TRANSFER_FAILED)])
        return prefill_answer(first_token_id=request.first_token_id)

    def _decode(self, request: wpb.DecodeRequest) -> StreamCall:
        self.decoded_after.append(request.first_token_id)
        done = cpb.Complete(finish_reason=cpb.FINISH_REASON_LENGTH, usage=cpb.Usage(completion_tokens=1))
        return StreamCall(
            [wpb.DecodeResponse(chunk=cpb.Chunk(token_ids=[8])), wpb.DecodeResponse(complete=done)], end=True
        )


def test_a_transfer_that_fails_after_the_first_token_is_retried_keeping_that_token():
    """The client has token 7 before the pages move; the pair's transfer fails; the retry on
    the other pair is told to emit 7 first, and the client gets 7 once, then the rest."""
    api, stubs = router(), _FailAfterFirstToken()

    async def scenario():
        await unreachable_ready_pairs(api, ["p0", "p1"], ["d0"])
        api.cluster.decode_stub, api.cluster.prefill_stub = stubs.decode, stubs.prefill
        return await _generate(api, max_tokens=2)

    messages = asyncio.run(scenario())
    chunks = [list(m.chunk.token_ids) for m in messages if m.WhichOneof("payload") == "chunk"]
    assert (chunks, stubs.forced, stubs.decoded_after) == ([[7], [8]], [None, 7], [7])
    assert messages[-1].complete.finish_reason == cpb.FINISH_REASON_LENGTH
    assert messages[-1].complete.usage.completion_tokens == 2
    assert api.cluster.registry.pairs[(stubs.prefills[0], "d0")].state == PairState.DEGRADED


def test_a_prefill_lost_after_the_first_token_with_no_pair_left_fails_and_is_not_forwarded():
    """The client has token 7; the only pair's prefill worker fails (not its transfer); an
    aggregated worker would sample a first token of its own, so the request ends with an
    error naming why, its usage counting the one token, and nothing is forwarded."""
    api, stubs, forwarded = router(), _Stubs(), []

    async def scenario():
        await unreachable_ready_pairs(api, ["p0"], ["d0"])
        both = rank_info("both-0", rpb.ROLE_BOTH)
        await api.registration.register(reg.RegisterRequest(rank_info=both))
        api.cluster.decode_stub = stubs.decode
        prefill = type("Prefill", (), {})()
        prefill.Prefill = lambda request, timeout: StreamCall(
            [wpb.PrefillResponse(first_token_id=7), _unavailable("prefill worker p0 is shutting down")]
        )
        api.cluster.prefill_stub = lambda worker_id: prefill
        tandem = type("Tandem", (), {})()
        tandem.Generate = lambda request, metadata=None: forwarded.append(request)
        api.cluster.tandem_stub = lambda worker_id: tandem
        return await _generate(api, max_tokens=4)

    messages = asyncio.run(scenario())
    assert [m.WhichOneof("payload") for m in messages] == ["chunk", "error", "complete"]
    assert list(messages[0].chunk.token_ids) == [7] and forwarded == []
    assert messages[1].error.message == "no ready prefill/decode pair (tried ['p0'])"
    assert messages[2].complete.usage.completion_tokens == 1
