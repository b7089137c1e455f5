"""Release paths that a second cancel must not skip: the prefill worker's release of a
parked request after its transfer, and the decode worker's freeing of a dropped
reservation. Each is cancelled once in its work and again while its release waits for
the engine thread; the release must still run. The prefill worker's answer does not wait
for its release, nor does its first token wait for the transfer."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import worker_pb2 as wpb
from services.common.metrics import Metrics
from services.decode.server import DecodeServicer, _Reservation
from services.prefill.server import PrefillServicer
from services.worker.engine_loop import EngineLoop


class _Engine:
    """What the servicers call between engine steps; records what was freed."""

    def __init__(self) -> None:
        self.freed: list[str] = []

    def has_unfinished(self) -> bool:
        return False

    def holds_reservation(self, rid: str) -> bool:
        return rid not in self.freed

    def release_reservation(self, rid: str) -> bool:
        self.freed.append(rid)
        return True

    def release(self, rid: str) -> None:
        self.freed.append(rid)


class _PrefilledLoop(EngineLoop):
    """An engine loop whose every request is prefilled (parked) at once."""

    async def outputs(self, rid, submit):
        usage = SimpleNamespace(cached_tokens={})
        yield SimpleNamespace(
            finish_reason="prefilled", finished=True, usage=usage, token_ids=[7], logprobs=None
        )


class _Context:
    """A Prefill call's server side: what was written to the stream."""

    def __init__(self) -> None:
        self.written: list[wpb.PrefillResponse] = []

    async def write(self, message: wpb.PrefillResponse) -> None:
        self.written.append(message)


def _prefill_servicer(engine: _Engine, loop: EngineLoop, record_finished) -> PrefillServicer:
    """A prefill servicer over ``engine`` and ``loop``, paired with decode worker d0."""
    worker = SimpleNamespace(
        engine=engine,
        loop=loop,
        metrics=Metrics("prefill"),
        draining="",
        in_flight=0,
        record_finished=record_finished,
    )
    return PrefillServicer(worker, SimpleNamespace(peers={"d0": None}))


async def _cancel_twice(task: asyncio.Task, started: asyncio.Event, loop: EngineLoop) -> None:
    """Cancel ``task`` in its work, and again while its release waits for the engine loop
    (not yet started); then start the loop and let the release run, if it is still asked."""
    await started.wait()
    task.cancel()
    for _ in range(3):
        await asyncio.sleep(0)
    task.cancel()
    loop.start()
    await asyncio.sleep(0.05)
    assert task.cancelled()
    await loop.stop()


def test_the_prefill_workers_release_survives_a_second_cancel():
    engine = _Engine()

    async def scenario():
        loop = _PrefilledLoop(engine)
        worker = SimpleNamespace(
            engine=engine, loop=loop, metrics=Metrics("prefill"), draining="", in_flight=0
        )
        servicer = PrefillServicer(worker, SimpleNamespace(peers={"d0": None}))
        started = asyncio.Event()

        async def stalled_transfer(request, target, final, context):
            started.set()
            await asyncio.sleep(60)  # the decode worker never acknowledges

        servicer._transfer = stalled_transfer
        reservation = wpb.Reservation(decode_instance_id="d0", groups=[wpb.GroupPages(group="target")])
        request = wpb.PrefillRequest(request_id="r", prompt_token_ids=[1, 2, 3], reservation=reservation)
        task = asyncio.ensure_future(servicer.Prefill(request, _Context()))
        await _cancel_twice(task, started, loop)

    asyncio.run(scenario())
    assert engine.freed == ["r"]


def test_the_decode_workers_freeing_of_a_dropped_reservation_survives_a_second_cancel():
    engine = _Engine()

    async def scenario():
        loop = EngineLoop(engine)
        worker = SimpleNamespace(engine=engine, loop=loop, metrics=Metrics("decode"), on_shutdown=[])
        servicer = DecodeServicer(worker)
        receive = asyncio.ensure_future(asyncio.sleep(60))
        servicer.reserved["r"] = _Reservation(3, 0.0, receive, [])
        started = asyncio.Event()
        started.set()  # _drop's first await is the freeing itself: cancel it there, twice
        task = asyncio.ensure_future(servicer._drop("r"))
        await asyncio.sleep(0)
        await _cancel_twice(task, started, loop)
        assert "r" not in servicer.reserved and receive.cancelled()

    asyncio.run(scenario())
    assert engine.freed == ["r"]


def test_the_prefill_answer_does_not_wait_for_the_engine_thread_to_release():
    """The first token goes back while the engine thread is busy (here: not started); the
    parked request's release runs once the engine thread takes calls again."""
    engine = _Engine()

    async def scenario():
        loop, finished = _PrefilledLoop(engine), []
        servicer = _prefill_servicer(engine, loop, lambda *a, **k: finished.append(a[1]))

        async def transferred(request, target, final, context):
            return wpb.PrefillResponse().usage

        servicer._transfer = transferred
        reservation = wpb.Reservation(decode_instance_id="d0", groups=[wpb.GroupPages(group="target")])
        request = wpb.PrefillRequest(request_id="r", prompt_token_ids=[1, 2, 3], reservation=reservation)
        context = _Context()
        await asyncio.wait_for(servicer.Prefill(request, context), 5)
        answer = context.written[0]
        freed_before = list(engine.freed)
        loop.start()
        for _ in range(100):
            if engine.freed:
                break
            await asyncio.sleep(0.01)
        await loop.stop()
        return answer, freed_before, finished

    answer, freed_before, finished = asyncio.run(scenario())
    assert (answer.first_token_id, freed_before, engine.freed, finished) == (7, [], ["r"], ["ok"])


def test_the_first_token_goes_out_before_the_transfer_and_the_usage_after_it():
    """The stream's first message (the first token) is written while the transfer still
    waits for the decode worker's acknowledgement; the usage comes once it landed."""
    engine = _Engine()

    async def scenario():
        loop = _PrefilledLoop(engine)
        servicer = _prefill_servicer(engine, loop, lambda *a, **k: None)
        acked, context = asyncio.Event(), _Context()
        written_during = []

        async def transfer(request, target, final, context_):
            written_during.extend(context.written)
            await acked.wait()
            return cpb.Usage(prompt_tokens=3, transfers=[cpb.GroupTransfer(group="target")])

        servicer._transfer = transfer
        reservation = wpb.Reservation(decode_instance_id="d0", groups=[wpb.GroupPages(group="target")])
        request = wpb.PrefillRequest(request_id="r", prompt_token_ids=[1, 2, 3], reservation=reservation)
        call = asyncio.ensure_future(servicer.Prefill(request, context))
        for _ in range(100):
            if written_during:
                break
            await asyncio.sleep(0.01)
        during = [(m.first_token_id, len(m.usage.transfers)) for m in written_during]
        acked.set()
        await asyncio.wait_for(call, 5)
        loop.start()
        await loop.stop()
        return during, [(m.first_token_id, len(m.usage.transfers)) for m in context.written]

    during, written = asyncio.run(scenario())
    assert (during, written) == ([(7, 0)], [(7, 0), (0, 1)])
