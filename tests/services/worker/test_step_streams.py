"""A worker's Steps streams over real gRPC: one message per event-loop turn for every
request's chunks, in order; a call bound by its metadata; a closed stream refusing puts."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.common.steps_metadata import STEPS_METADATA
from services.worker.step_streams import Outbox, StepsClosed, StepStreams, batches


def _chunk(*ids: int) -> cpb.Chunk:
    return cpb.Chunk(token_ids=list(ids))


def test_an_outbox_gives_everything_put_in_one_take_in_order():
    async def scenario():
        box = Outbox("s")
        for rid, token in (("a", 1), ("b", 2), ("a", 3)):
            box.put(rid, _chunk(token))
        taken = await box.take()
        return [(c.request_id, list(c.chunk.token_ids)) for c in taken]

    assert asyncio.run(scenario()) == [("a", [1]), ("b", [2]), ("a", [3])]


def test_a_closed_outbox_refuses_puts_naming_its_stream_and_why():
    box = Outbox("r1.7")
    box.close("ended")
    with pytest.raises(StepsClosed, match=r"steps stream 'r1.7' ended"):
        box.put("a", _chunk(1))


class _Context:
    def __init__(self, metadata) -> None:
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata


def test_a_call_is_bound_to_the_stream_its_metadata_names_if_held():
    steps = StepStreams()
    steps.outboxes["s1"] = box = Outbox("s1")
    assert steps.bound(_Context([("authorization", "x"), (STEPS_METADATA, "s1")])) is box
    assert steps.bound(_Context([(STEPS_METADATA, "gone")])) is None
    assert steps.bound(_Context(None)) is None


async def _served(steps: StepStreams) -> tuple[grpc.aio.Server, grpc.aio.Channel]:
    server = grpc.aio.server()
    wpb_grpc.add_WorkerStreamsServicer_to_server(steps, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def test_a_steps_stream_sends_an_empty_first_message_then_a_turns_chunks_as_one():
    async def scenario():
        steps = StepStreams()
        server, channel = await _served(steps)
        call = wpb_grpc.WorkerStreamsStub(channel).Steps(wpb.StepsRequest(stream_id="s"))
        first = await call.read()
        box = steps.outboxes["s"]
        for rid in ("a", "b", "c"):  # one turn: the writer runs after all three
            box.put(rid, _chunk(ord(rid)))
        second = await call.read()
        box.put("a", _chunk(9))
        third = await call.read()
        call.cancel()  # the router went away: the worker's stream ends and forgets the id
        for _ in range(200):
            if box.closed:
                break
            await asyncio.sleep(0.01)
        left = dict(steps.outboxes)
        await channel.close()
        await server.stop(None)
        return first, second, third, left, box.closed

    first, second, third, left, closed = asyncio.run(scenario())
    assert len(first.chunks) == 0
    shown = [[(c.request_id, list(c.chunk.token_ids)) for c in m.chunks] for m in (second, third)]
    assert shown == [[("a", [97]), ("b", [98]), ("c", [99])], [("a", [9])]]
    assert (left, closed) == ({}, "ended")


def test_a_new_stream_of_the_same_id_closes_the_older_one():
    async def scenario():
        steps = StepStreams()
        server, channel = await _served(steps)
        stub = wpb_grpc.WorkerStreamsStub(channel)
        older = stub.Steps(wpb.StepsRequest(stream_id="s"))
        await older.read()
        old_box = steps.outboxes["s"]
        newer = stub.Steps(wpb.StepsRequest(stream_id="s"))
        await newer.read()
        ended = await older.read()
        newer.cancel()
        await channel.close()
        await server.stop(None)
        return old_box.closed, ended

    closed, ended = asyncio.run(scenario())
    assert (closed, ended) == ("was replaced by a new stream of that id", grpc.aio.EOF)


def test_a_steps_stream_without_an_id_is_refused():
    async def scenario():
        server, channel = await _served(StepStreams())
        try:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await wpb_grpc.WorkerStreamsStub(channel).Steps(wpb.StepsRequest()).read()
            return raised.value.code(), raised.value.details()
        finally:
            await channel.close()
            await server.stop(None)

    assert asyncio.run(scenario()) == (grpc.StatusCode.INVALID_ARGUMENT, "stream_id: empty")


def test_chunks_are_cut_into_messages_under_the_size_limit_in_order():
    lengths = (30, 30, 200, 5)
    chunks = [wpb.RequestChunk(request_id=f"r{i}", chunk=_chunk(*range(n))) for i, n in enumerate(lengths)]
    sizes = [c.ByteSize() for c in chunks]
    limit = sizes[0] + sizes[1]  # the first two fit together; the third is over on its own
    cut = batches(chunks, limit)
    assert [[c.request_id for c in batch] for batch in cut] == [["r0", "r1"], ["r2"], ["r3"]]
    assert sizes[2] > limit and batches([], limit) == []
