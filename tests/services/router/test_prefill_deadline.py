"""A long prefill: the router renews the decode worker's lease while its Prefill runs, the
Prefill's deadline grows with the prompt, and a Prefill past it ends the request with a
message naming the deadline (not "no ready pair" after retries elsewhere)."""

from __future__ import annotations

import asyncio
import time

import grpc

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import worker_pb2 as wpb
from services.router.api import RouterSettings
from services.router.cluster import Deadlines
from services.router.step_failures import STARTUP_WAIT_S
from tests.services.router.helpers import StreamCall, prefill_answer, router, unreachable_ready_pairs

PROMPT = [1 + i % 200 for i in range(2000)]
LEASE_S = 0.9  # the decode worker's lease: shorter than the prefill below


class _Stubs:
    """A decode worker that reserves under LEASE_S and counts renewals; a prefill worker
    that answers after ``prefill_s`` seconds, or with ``error``."""

    def __init__(self, prefill_s: float = 0.0, error: grpc.StatusCode | None = None) -> None:
        self.prefill_s, self.error = prefill_s, error
        self.renewals: list[str] = []
        self.releases: list[str] = []
        self.prefill_timeouts: list[float] = []

    def decode(self, worker_id: str):
        stub = type("Decode", (), {})()
        stub.Reserve = lambda request, timeout: self._reserve(request, worker_id)
        stub.Renew = lambda request, timeout: self._renew(request)
        stub.Release = lambda request, timeout: self._release(request)
        return stub

    def prefill(self, worker_id: str):
        stub = type("Prefill", (), {})()
        stub.Prefill = lambda request, timeout: self._prefill(timeout)
        return stub

    async def _reserve(self, request, worker_id):
        deadline = int((time.time() + LEASE_S) * 1000)
        reservation = wpb.Reservation(
            request_id=request.request_id, decode_instance_id=worker_id, lease_deadline_unix_ms=deadline
        )
        return wpb.ReserveResponse(reservation=reservation)

    async def _renew(self, request):
        self.renewals.append(request.request_id)
        return wpb.RenewResponse(lease_deadline_unix_ms=int((time.time() + LEASE_S) * 1000))

    async def _release(self, request):
        self.releases.append(request.request_id)
        return wpb.ReleaseResponse(released=True)

    def _prefill(self, timeout: float) -> StreamCall:
        self.prefill_timeouts.append(timeout)
        if self.error is not None:
            error = grpc.aio.AioRpcError(
                self.error, grpc.aio.Metadata(), grpc.aio.Metadata(), "Deadline Exceeded"
            )
            return StreamCall([error], delay_s=self.prefill_s)
        call = prefill_answer(finish_reason=cpb.FINISH_REASON_LENGTH)
        call.delay_s = self.prefill_s
        return call


def _run(stubs: _Stubs) -> list[cpb.GenerateResponse]:
    api = router(max_model_len=4096)

    async def scenario():
        await unreachable_ready_pairs(api, ["p0"], ["d0"])
        api.cluster.decode_stub, api.cluster.prefill_stub = stubs.decode, stubs.prefill
        api.cluster.deadlines = Deadlines(call_s=3.0, prefill_s=20.0, prefill_per_1k_s=5.0)
        request = cpb.GenerateRequest(
            request_id="r", token_ids=cpb.TokenIds(ids=PROMPT), sampling=cpb.SamplingParams(max_tokens=1)
        )
        messages = [m async for m in api.generate(request)]
        await api.close()
        return messages

    return asyncio.run(scenario())


def test_the_lease_is_renewed_while_the_prefill_runs_and_the_deadline_grows_with_the_prompt():
    stubs = _Stubs(prefill_s=2 * LEASE_S)
    messages = _run(stubs)
    assert messages[-1].complete.finish_reason == cpb.FINISH_REASON_LENGTH
    assert stubs.prefill_timeouts == [30.0]  # 20 s + 5 s per 1,000 of 2,000 tokens
    assert len(stubs.renewals) >= 2 and len(set(stubs.renewals)) == 1  # every LEASE_S / 3, one attempt
    assert stubs.renewals[0].startswith("r#") and stubs.renewals[0].endswith(".1")


def test_a_prefill_past_its_deadline_ends_the_request_naming_it():
    stubs = _Stubs(error=grpc.StatusCode.DEADLINE_EXCEEDED)
    messages = _run(stubs)
    assert [m.WhichOneof("payload") for m in messages] == ["error", "complete"]
    assert messages[0].error.message == (
        "prefill of 2000 tokens on p0 did not finish within its deadline, 30 s "
        "(--prefill-timeout-s 20 plus --prefill-timeout-per-1k-tokens-s 5 per 1,000 tokens)"
    )
    assert len(stubs.prefill_timeouts) == 1 and len(stubs.releases) == 1  # not retried
    assert stubs.releases[0].startswith("r#") and stubs.releases[0].endswith(".1")


def test_a_new_routers_requests_wait_for_its_first_workers():
    """A restarted router answered 'no ready pair' for the 1.5 s its workers took to
    register again; its requests now wait (at most STARTUP_WAIT_S) for them."""
    stubs = _Stubs()
    api = router(RouterSettings(tokens_per_page=4, startup_wait_s=STARTUP_WAIT_S), max_model_len=4096)

    async def scenario():
        request = cpb.GenerateRequest(
            request_id="early",
            token_ids=cpb.TokenIds(ids=PROMPT[:8]),
            sampling=cpb.SamplingParams(max_tokens=1),
        )
        early = asyncio.ensure_future(_collect(api.generate(request)))
        await asyncio.sleep(0.5)  # no worker yet: the request waits
        assert not early.done()
        await unreachable_ready_pairs(api, ["p0"], ["d0"])
        api.cluster.decode_stub, api.cluster.prefill_stub = stubs.decode, stubs.prefill
        messages = await asyncio.wait_for(early, 10)
        await api.close()
        return messages

    messages = asyncio.run(scenario())
    assert messages[-1].complete.finish_reason == cpb.FINISH_REASON_LENGTH


async def _collect(messages) -> list[cpb.GenerateResponse]:
    return [m async for m in messages]
