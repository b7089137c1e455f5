"""A Decode stream's idle deadline: a stream that stops sending is cancelled, and the
request, which has streamed tokens, ends UNAVAILABLE naming the decode worker."""

from __future__ import annotations

import asyncio

import pytest

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import worker_pb2 as wpb
from services.router.cluster import Deadlines
from services.router.errors import ErrorCode, RouterError
from services.router.streams import StreamStalled, idle_bounded
from tests.services.router.helpers import (
    StreamCall,
    prefill_answer,
    rank_info,
    router,
    unreachable_ready_pairs,
)

PROMPT = [5, 6, 7, 8, 9]


async def _all(messages) -> list:
    return [m async for m in messages]


def test_a_stream_that_ends_yields_all_its_messages():
    stream = StreamCall(["a", "b"], end=True)
    assert asyncio.run(_all(idle_bounded(stream, 0.2))) == ["a", "b"]
    assert not stream.cancelled


def test_a_stream_that_stops_sending_is_cancelled_at_its_idle_deadline():
    stream, seen = StreamCall(["a"]), []

    async def read_all():
        async for message in idle_bounded(stream, 0.2):
            seen.append(message)

    with pytest.raises(StreamStalled) as raised:
        asyncio.run(read_all())
    assert (seen, stream.cancelled, raised.value.idle_s) == (["a"], True, 0.2)


class _Stubs:
    """A decode worker that reserves and whose Decode sends one chunk, then nothing; a
    prefill worker that answers the first token."""

    def __init__(self) -> None:
        self.stream = StreamCall([wpb.DecodeResponse(chunk=cpb.Chunk(token_ids=[8]))])

    def decode(self, worker_id: str):
        stub = type("Decode", (), {})()
        reservation = wpb.Reservation(request_id="r", decode_instance_id=worker_id)
        stub.Reserve = lambda request, timeout: _answer(wpb.ReserveResponse(reservation=reservation))
        stub.Release = lambda request, timeout: _answer(wpb.ReleaseResponse(released=False))
        stub.Decode = lambda request, metadata=None: self.stream
        return stub

    def prefill(self, worker_id: str):
        stub = type("Prefill", (), {})()
        stub.Prefill = lambda request, timeout: prefill_answer()
        return stub


async def _answer(response):
    return response


def _stalled(setup) -> tuple[RouterError, list[int]]:
    """Run one request on a router that ``setup(api)`` wires to its stub workers, under a
    0.2 s stream idle deadline; returns the RouterError it ends with and the tokens it got."""
    api, tokens = router(), []

    async def scenario():
        await setup(api)
        api.cluster.deadlines = Deadlines(stream_idle_s=0.2)
        request = cpb.GenerateRequest(
            request_id="r", token_ids=cpb.TokenIds(ids=PROMPT), sampling=cpb.SamplingParams(max_tokens=8)
        )
        try:
            async for message in api.generate(request):
                tokens.extend(message.chunk.token_ids)
        finally:
            await api.close()

    with pytest.raises(RouterError) as raised:
        asyncio.run(scenario())
    return raised.value, tokens


def test_a_decode_stream_past_its_idle_deadline_ends_the_request_unavailable():
    stubs = _Stubs()

    async def setup(api):
        await unreachable_ready_pairs(api, ["p0"], ["d0"])
        api.cluster.decode_stub, api.cluster.prefill_stub = stubs.decode, stubs.prefill

    error, tokens = _stalled(setup)
    assert (error.code, error.message) == (ErrorCode.UNAVAILABLE, "decode worker d0 sent nothing for 0.2 s")
    assert tokens == [7, 8] and stubs.stream.cancelled


def test_an_aggregated_workers_stream_past_its_idle_deadline_ends_unavailable():
    stream = StreamCall([cpb.GenerateResponse(request_id="r", chunk=cpb.Chunk(token_ids=[7]))])

    async def setup(api):
        await api.registration.register(reg.RegisterRequest(rank_info=rank_info("both-0", rpb.ROLE_BOTH)))
        tandem = type("Tandem", (), {})()
        tandem.Generate = lambda request, metadata=None: stream
        api.cluster.tandem_stub = lambda worker_id: tandem

    error, tokens = _stalled(setup)
    assert (error.code, error.message) == (ErrorCode.UNAVAILABLE, "worker both-0 sent nothing for 0.2 s")
    assert tokens == [7] and stream.cancelled
