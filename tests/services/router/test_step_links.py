"""The router's side of the Steps streams: a call's chunks from its worker's Steps stream
relayed in the call's place, in order, with the call's complete held until its tokens came;
and a link that opens the stream, puts each request's chunks in its mailbox, and tells
every attached mailbox when the stream ends."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.common.steps_metadata import STEPS_METADATA
from services.router.step_links import LINK_DOWN, Mailbox, StepsLink
from services.router.streams import StepsLost, StreamStalled, steps_relayed
from services.worker.step_streams import StepStreams
from tests.services.router.helpers import StreamCall


def _complete(tokens: int) -> wpb.DecodeResponse:
    usage = cpb.Usage(completion_tokens=tokens)
    return wpb.DecodeResponse(complete=cpb.Complete(finish_reason=cpb.FINISH_REASON_LENGTH, usage=usage))


def _as_message(chunk: cpb.Chunk) -> wpb.DecodeResponse:
    return wpb.DecodeResponse(chunk=chunk)


def _shown(message) -> object:
    kind = message.WhichOneof("payload")
    if kind == "chunk":
        return list(message.chunk.token_ids)
    if kind == "error":
        return f"error: {message.error.message}"
    return f"complete: {message.complete.usage.completion_tokens}"


async def _relayed(call: StreamCall, box: Mailbox, idle_s: float = 5.0) -> list:
    return [_shown(m) async for m in steps_relayed(call, box, idle_s, _as_message, "d0")]


def test_a_complete_that_overtakes_its_last_chunks_waits_for_them():
    async def scenario():
        box, call = Mailbox(), StreamCall([_complete(3)], end=True)
        box.put(cpb.Chunk(token_ids=[1]))

        async def late():
            await asyncio.sleep(0.05)
            box.put(cpb.Chunk(token_ids=[2, 3]))

        task = asyncio.ensure_future(late())
        out = await _relayed(call, box)
        await task
        return out

    assert asyncio.run(scenario()) == [[1], [2, 3], "complete: 3"]


def test_chunks_that_queued_come_as_one_but_never_the_first():
    async def scenario():
        box = Mailbox()
        for token in (1, 2, 3, 4):
            box.put(cpb.Chunk(token_ids=[token], logprobs=[cpb.TokenLogprobs(token_id=token)]))
        out = [m async for m in steps_relayed(StreamCall([_complete(4)]), box, 5.0, _as_message, "d0")]
        return [([*m.chunk.token_ids], [lp.token_id for lp in m.chunk.logprobs]) for m in out[:-1]]

    assert asyncio.run(scenario()) == [([1], [1]), ([2, 3, 4], [2, 3, 4])]


def test_an_error_and_the_complete_come_after_every_chunk():
    async def scenario():
        box = Mailbox()
        error = wpb.DecodeResponse(error=cpb.Error(message="grammar"))
        call = StreamCall([error, _complete(2)])

        async def late():
            await asyncio.sleep(0.05)
            box.put(cpb.Chunk(token_ids=[5]))
            await asyncio.sleep(0.02)
            box.put(cpb.Chunk(token_ids=[6]))

        task = asyncio.ensure_future(late())
        out = await _relayed(call, box)
        await task
        return out

    assert asyncio.run(scenario()) == [[5], [6], "error: grammar", "complete: 2"]


def test_a_call_that_streams_its_own_chunks_is_relayed_as_it_comes():
    chunk = wpb.DecodeResponse(chunk=cpb.Chunk(token_ids=[7, 8]))
    assert asyncio.run(_relayed(StreamCall([chunk, _complete(2)]), Mailbox())) == [[7, 8], "complete: 2"]


def test_a_stream_that_ends_with_a_completed_calls_chunks_missing_raises_steps_lost():
    async def scenario():
        box = Mailbox()
        box.put(cpb.Chunk(token_ids=[1]))
        box.put(LINK_DOWN)
        seen = []
        with pytest.raises(StepsLost, match="its steps stream of worker d0 ended"):
            call = StreamCall([_complete(3)], end=True)
            async for message in steps_relayed(call, box, 5.0, _as_message, "d0"):
                seen.append(_shown(message))
        return seen

    assert asyncio.run(scenario()) == [[1]]


def test_a_stream_that_ends_under_a_running_call_waits_for_the_calls_own_end():
    details = "the router's steps stream 's' ended"
    error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, details)

    async def scenario():
        box = Mailbox()
        box.put(LINK_DOWN)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await _relayed(StreamCall([error]), box)
        return raised.value.code()

    assert asyncio.run(scenario()) == grpc.StatusCode.UNAVAILABLE


def test_nothing_from_either_stream_within_the_idle_deadline_cancels_the_call():
    async def scenario():
        call = StreamCall([], end=False)
        with pytest.raises(StreamStalled):
            await _relayed(call, Mailbox(), idle_s=0.1)
        return call.cancelled

    assert asyncio.run(scenario())


async def _worker() -> tuple[StepStreams, grpc.aio.Server, grpc.aio.Channel]:
    steps = StepStreams()
    server = grpc.aio.server()
    wpb_grpc.add_WorkerStreamsServicer_to_server(steps, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return steps, server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


async def _until(predicate) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_a_link_relays_each_attempts_chunks_and_tells_its_mailboxes_when_the_stream_ends():
    async def scenario():
        steps, server, channel = await _worker()
        link = StepsLink(channel, "d0")
        not_ready = link.attach("early")
        await _until(lambda: link.ready)
        box, metadata = link.attach("r#1.1")
        other, _ = link.attach("r#2.1")
        stream_id = metadata[0][1]
        outbox = steps.outboxes[stream_id]
        outbox.put("r#1.1", cpb.Chunk(token_ids=[1]))
        outbox.put("gone", cpb.Chunk(token_ids=[9]))  # no mailbox: dropped
        outbox.put("r#2.1", cpb.Chunk(token_ids=[2]))
        got = [await box.take(), await other.take()]
        link.call.cancel()  # the stream ends; the link opens another under a new id
        down = await box.take()
        await _until(lambda: link.ready)
        reopened = link.stream_id
        link.close()
        await channel.close()
        await server.stop(None)
        return not_ready, metadata, got, down, stream_id, reopened, link.mailboxes

    not_ready, metadata, got, down, stream_id, reopened, left = asyncio.run(scenario())
    assert not_ready == (None, None)
    assert metadata == ((STEPS_METADATA, stream_id),)
    assert [[list(c.token_ids) for c in items] for items in got] == [[[1]], [[2]]]
    assert down == [LINK_DOWN]
    assert reopened not in ("", stream_id)
    assert left == {}


def test_a_worker_without_steps_streams_is_not_asked_again():
    async def scenario():
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        link = StepsLink(channel, "old")
        await asyncio.wait_for(link._task, 5)
        answer = link.attach("r")
        await channel.close()
        await server.stop(None)
        return answer

    assert asyncio.run(scenario()) == (None, None)
