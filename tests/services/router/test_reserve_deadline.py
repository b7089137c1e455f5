"""The router's Reserve call: it carries the configured deadline, the health check losing
its decode worker cancels it, and either way the request is retried on another pair while
what the first worker may have reserved is released."""

from __future__ import annotations

import asyncio

import grpc

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import worker_pb2 as wpb
from services.router.cluster import Deadlines
from tests.services.router.helpers import StreamCall, prefill_answer, router, unreachable_ready_pairs, until

PROMPT = [5, 6, 7, 8, 9]


class _Pending:
    """A unary call that answers only when told; ``cancel`` cancels it as grpc.aio does."""

    def __init__(self, result=None, error: grpc.aio.AioRpcError | None = None, hang: bool = False) -> None:
        self.future = asyncio.get_running_loop().create_future()
        if error is not None:
            self.future.set_exception(error)
        elif not hang:
            self.future.set_result(result)

    def cancel(self) -> None:
        self.future.cancel()

    def __await__(self):
        return self.future.__await__()


class _Stubs:
    """Decode stubs whose first Reserve hangs (or fails with ``first_error``); the others
    reserve; prefill stubs that finish the request at its first token."""

    def __init__(self, first_error: grpc.aio.AioRpcError | None = None) -> None:
        self.first_error = first_error
        self.reserves: list[tuple[str, float]] = []  # (decode id, timeout)
        self.releases: list[tuple[str, str]] = []  # (decode id, request id)
        self.prefill_timeouts: list[float] = []

    def decode(self, worker_id: str):
        stub = type("Decode", (), {})()
        stub.Reserve = lambda request, timeout: self._reserve(worker_id, timeout)
        stub.Release = lambda request, timeout: self._release(worker_id, request)
        return stub

    def prefill(self, worker_id: str):
        stub = type("Prefill", (), {})()
        stub.Prefill = lambda request, timeout: self._prefill(timeout)
        return stub

    def _reserve(self, worker_id: str, timeout: float) -> _Pending:
        self.reserves.append((worker_id, timeout))
        if len(self.reserves) == 1:
            return _Pending(error=self.first_error, hang=self.first_error is None)
        reservation = wpb.Reservation(request_id="r", decode_instance_id=worker_id)
        return _Pending(wpb.ReserveResponse(reservation=reservation))

    def _release(self, worker_id: str, request: wpb.ReleaseRequest) -> _Pending:
        self.releases.append((worker_id, request.request_id))
        return _Pending(wpb.ReleaseResponse(released=True))

    def _prefill(self, timeout: float) -> StreamCall:
        self.prefill_timeouts.append(timeout)
        return prefill_answer(finish_reason=cpb.FINISH_REASON_LENGTH)


def _request() -> cpb.GenerateRequest:
    sampling = cpb.SamplingParams(max_tokens=1)
    return cpb.GenerateRequest(request_id="r", token_ids=cpb.TokenIds(ids=PROMPT), sampling=sampling)


def _run(stubs: _Stubs, lose_first: bool) -> list[cpb.GenerateResponse]:
    api = router()

    async def scenario():
        await unreachable_ready_pairs(api, ["p0"], ["d0", "d1"])
        api.cluster.decode_stub, api.cluster.prefill_stub = stubs.decode, stubs.prefill
        api.cluster.deadlines = Deadlines(call_s=3.0, prefill_s=7.0, prefill_per_1k_s=0.0)
        task = asyncio.ensure_future(_collect(api.generate(_request())))
        if lose_first:
            await until(lambda: len(stubs.reserves) == 1)
            lost = stubs.reserves[0][0]
            api.cluster.registry.workers[lost].healthy = False  # as the failed poll marks it
            api.health_monitor.lose(lost)
        messages = await asyncio.wait_for(task, 10)  # a Reserve nobody cancels hangs
        await until(lambda: len(stubs.releases) == 2)
        await api.close()
        return messages

    return asyncio.run(scenario())


async def _collect(messages) -> list[cpb.GenerateResponse]:
    return [m async for m in messages]


def test_a_reserve_on_a_worker_the_health_check_loses_is_cancelled_and_retried_elsewhere():
    stubs = _Stubs()
    messages = _run(stubs, lose_first=True)
    assert [m.WhichOneof("payload") for m in messages] == ["chunk", "complete"]
    assert messages[-1].complete.finish_reason == cpb.FINISH_REASON_LENGTH
    (first, t1), (second, t2) = stubs.reserves
    assert {first, second} == {"d0", "d1"} and (t1, t2) == (3.0, 3.0)
    assert stubs.prefill_timeouts == [7.0]
    # the lost worker's, in case it comes back holding pages; the second's, as the request
    # ended at its first token: each attempt under its own id
    assert _attempts(stubs.releases) == sorted([(first, "1"), (second, "2")])


def test_a_reserve_past_its_deadline_is_retried_elsewhere_and_released():
    late = grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "Deadline Exceeded"
    )
    stubs = _Stubs(first_error=late)
    messages = _run(stubs, lose_first=False)
    assert messages[-1].complete.finish_reason == cpb.FINISH_REASON_LENGTH
    (first, _), (second, _) = stubs.reserves
    assert first != second
    assert _attempts(stubs.releases) == sorted([(first, "1"), (second, "2")])


def _attempts(releases: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(decode id, attempt number) of each release, in order; every attempt id is
    ``r#<serial>.<n>`` with one serial for the whole request."""
    serials = {rid.rsplit(".", 1)[0] for _, rid in releases}
    assert len(serials) == 1 and next(iter(serials)).startswith("r#"), releases
    return sorted((d, rid.rsplit(".", 1)[1]) for d, rid in releases)
