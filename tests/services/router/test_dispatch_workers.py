"""RequestFlow against real workers in this process: a router and a prefill and a decode
worker serve on one event loop in a thread (real gRPC servers, engines and UCX over shared
memory; no child processes), over the tiny random pair."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine

import pytest

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import worker_pb2 as wpb
from services.common import faults
from services.engine.config import EngineConfig
from services.router.api import RouterSettings
from services.router.errors import ErrorCode, RouterError
from services.router.main import RouterConfig, model_limits, run_router
from services.router.step_links import Mailbox
from services.worker.serve import run_worker
from services.worker.worker import WorkerConfig
from services.worker_roles import WORKER_ROLES
from tests.services.engine.helpers import write_pair

K = 2
PAGE = 4
DECODE_PAGES = 24  # per group: 96 tokens, so a 200-token prompt never finds room there
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]

Serve = Callable[[asyncio.Event, asyncio.Event], Coroutine]


class InProcessCluster:
    """Services on one event loop in a daemon thread; ``run`` runs a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stops: list[asyncio.Event] = []
        self.tasks: list[asyncio.Future] = []
        self.bound: dict = {}

    def run(self, coro: Coroutine, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def serve(self, serve: Serve, timeout_s: float = 120.0) -> None:
        async def start():
            ready, stop = asyncio.Event(), asyncio.Event()
            task = asyncio.ensure_future(serve(ready, stop))
            await asyncio.wait([task, asyncio.ensure_future(ready.wait())], return_when="FIRST_COMPLETED")
            if task.done():
                task.result()  # raises why it did not start
            self.stops.append(stop)
            self.tasks.append(task)

        self.run(start(), timeout_s)

    def close(self) -> None:
        async def stop():
            for event in reversed(self.stops):
                event.set()
            await asyncio.gather(*self.tasks, return_exceptions=True)

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _engine(target, drafter, num_pages: int) -> EngineConfig:
    return EngineConfig(
        model=str(target),
        drafter=str(drafter),
        num_spec_tokens=K,
        tokens_per_page=PAGE,
        num_pages=(num_pages, num_pages),
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_prefill_chunk=256,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    target, drafter = write_pair(tmp_path_factory.mktemp("pair"))
    services = InProcessCluster()
    limits = model_limits(str(target), K)
    services.serve(
        lambda ready, stop: run_router(
            RouterConfig(limits, RouterSettings(tokens_per_page=PAGE)), ready, stop, services.bound
        )
    )
    address = f"127.0.0.1:{services.bound['port']}"
    for role, pages in (("decode", DECODE_PAGES), ("prefill", 256)):
        config = WorkerConfig(role, _engine(target, drafter, pages), router=address, instance_id=f"{role}-0")
        services.serve(lambda ready, stop, c=config: run_worker(c, WORKER_ROLES[c.role], ready, stop))
    api = services.bound["router"]

    async def paired():
        while (await api.health()).num_ready_pairs < 1:
            await asyncio.sleep(0.05)

    services.run(paired())
    yield services
    services.close()


def _request(rid: str, prompt=PROMPT, max_tokens: int = 8) -> cpb.GenerateRequest:
    sampling = cpb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return cpb.GenerateRequest(request_id=rid, token_ids=cpb.TokenIds(ids=prompt), sampling=sampling)


async def _decode_pages_held(api) -> int:
    """Target-group pages the decode worker's requests hold (not only cached)."""
    stats = await api.cluster.decode_stub("decode-0").Stats(wpb.StatsRequest(), timeout=5)
    return stats.groups[0].num_pages_used - stats.groups[0].num_pages_cached


async def _until_no_pages_held(api) -> int:
    for _ in range(200):
        if (held := await _decode_pages_held(api)) == 0:
            return held
        await asyncio.sleep(0.05)
    return held


def _requests(api, status: str) -> float:
    return api.metrics.requests.labels("router", status)._value.get()


def test_a_request_runs_reserve_prefill_decode_and_reports_usage(cluster):
    api = cluster.bound["router"]

    async def scenario():
        messages = [m async for m in api.generate(_request("whole"))]
        return messages, await _until_no_pages_held(api)

    messages, held = cluster.run(scenario())
    chunks = [m.chunk for m in messages if m.WhichOneof("payload") == "chunk"]
    complete = messages[-1].complete
    assert [m.WhichOneof("payload") for m in messages[len(chunks) :]] == ["complete"]
    assert {m.request_id for m in messages} == {"whole"}
    assert len(chunks[0].token_ids) == 1  # the prefill's first token, on its own
    assert sum(len(c.token_ids) for c in chunks) == 8 == complete.usage.completion_tokens
    assert complete.finish_reason == cpb.FINISH_REASON_LENGTH
    assert complete.usage.prompt_tokens == len(PROMPT)
    assert sorted(t.group for t in complete.usage.transfers) == ["draft", "target"]
    assert held == 0  # the reservation became the request's pages, freed at its end
    registry = api.cluster.registry
    assert registry.index.cached_tokens("prefill-0", PROMPT) == len(PROMPT) // PAGE * PAGE
    assert registry.index.cached_tokens("decode-0", PROMPT) == len(PROMPT) // PAGE * PAGE


def test_an_abort_mid_stream_ends_the_request_and_frees_its_pages(cluster):
    api = cluster.bound["router"]

    async def scenario():
        messages = api.generate(_request("abort-me", max_tokens=64))
        head = [await anext(messages), await anext(messages)]  # the Decode stream is running
        found = await api.abort("abort-me")
        rest = [m async for m in messages]
        return head + rest, found, await _until_no_pages_held(api)

    messages, found, held = cluster.run(scenario())
    tokens = sum(len(m.chunk.token_ids) for m in messages)
    assert found and messages[-1].complete.finish_reason == cpb.FINISH_REASON_ABORT
    assert [m.WhichOneof("payload") for m in messages[:-1]] == ["chunk"] * (len(messages) - 1)
    assert tokens < 64 and held == 0 and not api.is_running("abort-me")


def test_an_abort_before_decode_starts_releases_the_reservation_instead(cluster):
    api = cluster.bound["router"]

    async def scenario():
        messages = api.generate(_request("abort-early", max_tokens=64))
        first = await anext(messages)  # the prefill's token; no Decode call yet
        found = await api.abort("abort-early")
        rest = [m async for m in messages]
        return [first, *rest], found, await _until_no_pages_held(api)

    messages, found, held = cluster.run(scenario())
    assert found and [m.WhichOneof("payload") for m in messages] == ["chunk", "complete"]
    assert messages[1].complete.finish_reason == cpb.FINISH_REASON_ABORT
    assert messages[1].complete.usage.completion_tokens == 1 and held == 0


def test_losing_the_decode_worker_after_the_first_token_fails_the_request_unavailable(cluster):
    api = cluster.bound["router"]
    before = _requests(api, "unavailable")

    async def scenario():
        messages = api.generate(_request("lost", max_tokens=64))
        await anext(messages)
        await anext(messages)  # the Decode stream is running
        api.health_monitor.lose("decode-0")
        with pytest.raises(RouterError) as e:
            async for _ in messages:
                pass
        return e.value, await _until_no_pages_held(api)

    error, held = cluster.run(scenario())
    assert (error.code, error.message) == (ErrorCode.UNAVAILABLE, "decode worker decode-0 is unavailable")
    assert _requests(api, "unavailable") == before + 1
    assert held == 0  # the cancelled Decode call freed the worker's pages


def _decoded(messages) -> list[list[int]]:
    return [list(m.chunk.token_ids) for m in messages if m.WhichOneof("payload") == "chunk"]


def test_decode_chunks_come_on_the_steps_stream_token_for_token_as_on_the_call(cluster, monkeypatch):
    api = cluster.bound["router"]
    link = api.cluster.links["decode-0"]
    relayed = []
    put = Mailbox.put
    monkeypatch.setattr(Mailbox, "put", lambda box, item: (relayed.append(item), put(box, item))[1])

    async def scenario():
        on_steps = [m async for m in api.generate(_request("steps", max_tokens=12))]
        counted = len([c for c in relayed if isinstance(c, cpb.Chunk)])
        link.ready = False  # attach() says no: the Decode call streams its own chunks
        try:
            on_call = [m async for m in api.generate(_request("call", max_tokens=12))]
        finally:
            link.ready = True
        after = len([c for c in relayed if isinstance(c, cpb.Chunk)])
        return on_steps, counted, on_call, after, link.mailboxes

    on_steps, counted, on_call, counted_after, attached = cluster.run(scenario())
    tokens = sum(_decoded(on_steps), [])
    assert len(tokens) == 12 and tokens == sum(_decoded(on_call), [])
    assert counted >= 1 and counted_after == counted  # the second request's chunks came on its call
    assert on_steps[-1].complete.usage.completion_tokens == 12
    assert attached == {}


def test_a_steps_stream_that_ends_mid_request_ends_it_unavailable_and_frees_its_pages(cluster, monkeypatch):
    api = cluster.bound["router"]
    link = api.cluster.links["decode-0"]
    monkeypatch.setitem(faults.FAULTS, "engine.step", 0.02)  # 64 tokens take over a second

    async def scenario():
        messages = api.generate(_request("cut", max_tokens=64))
        await anext(messages)
        await anext(messages)  # the Decode stream is running, its chunks on the Steps stream
        link.call.cancel()
        with pytest.raises(RouterError) as e:
            async for _ in messages:
                pass
        held = await _until_no_pages_held(api)
        while not link.ready:  # a new stream opens RETRY_S later
            await asyncio.sleep(0.05)
        after = [m async for m in api.generate(_request("after-cut", max_tokens=4))]
        return e.value, held, after

    error, held, after = cluster.run(scenario())
    assert error.code == ErrorCode.UNAVAILABLE
    assert error.message.startswith("decode worker decode-0 is unavailable: the router's steps stream ")
    assert error.message.endswith(" ended")
    assert held == 0
    assert after[-1].complete.usage.completion_tokens == 4


HOG_TOKENS = 60  # a reservation holding most of the decode worker's 96 tokens
QUEUED = [i % 30 for i in range(40)]  # fits the empty pool, not beside the hog


async def _hog(api) -> None:
    """Hold most of the decode worker's pages under a reservation of its own."""
    request = wpb.ReserveRequest(request_id="hog", prompt_len=HOG_TOKENS)
    await api.cluster.decode_stub("decode-0").Reserve(request, timeout=5)


async def _free_hog(api) -> None:
    await api.cluster.decode_stub("decode-0").Release(wpb.ReleaseRequest(request_id="hog"), timeout=5)


def test_a_prompt_the_decode_worker_can_never_hold_is_refused_at_once_naming_the_numbers(cluster):
    api = cluster.bound["router"]
    long_prompt = [i % 30 for i in range(200)]

    async def scenario():
        return [m async for m in api.generate(_request("too-long", long_prompt, max_tokens=4))]

    with pytest.raises(RouterError) as refused:
        cluster.run(scenario())
    kv = api.served().max_request_tokens
    assert 0 < kv < 200 and refused.value.code == ErrorCode.INVALID_ARGUMENT
    assert str(refused.value) == (
        f"prompt: 200 tokens leave no room in the {kv} tokens the workers' KV cache holds for one request"
    )
    assert api.metrics.waiting.labels("router")._value.get() == 0


def test_a_prompt_the_decode_worker_has_no_room_for_now_queues_until_its_timeout(cluster):
    api = cluster.bound["router"]
    api.queue_timeout_s = 0.3

    async def scenario():
        await _hog(api)
        try:
            return [m async for m in api.generate(_request("no-room", QUEUED, max_tokens=4))]
        finally:
            await _free_hog(api)

    try:
        messages = cluster.run(scenario())
    finally:
        api.queue_timeout_s = 120.0
    assert [m.WhichOneof("payload") for m in messages] == ["error", "complete"]
    assert messages[0].error.message == "no free KV pages within 0.3 s"
    assert messages[1].complete.finish_reason == cpb.FINISH_REASON_ERROR
    assert api.metrics.waiting.labels("router")._value.get() == 0


def test_a_queued_request_aborted_ends_with_abort(cluster):
    api = cluster.bound["router"]

    async def scenario():
        await _hog(api)
        try:
            messages = api.generate(_request("queued", QUEUED, max_tokens=4))
            head = asyncio.ensure_future(anext(messages))
            while not api.is_running("queued"):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # a few Reserve refusals later
            found = await api.abort("queued")
            return found, [await head] + [m async for m in messages]
        finally:
            await _free_hog(api)

    found, messages = cluster.run(scenario())
    assert found
    assert [m.WhichOneof("payload") for m in messages] == ["complete"]
    assert messages[0].complete.finish_reason == cpb.FINISH_REASON_ABORT
