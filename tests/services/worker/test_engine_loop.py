"""EngineLoop with a real engine on the CPU: the engine thread steps while streams, calls and
aborts come from the event loop. Outputs equal ``Engine.generate``'s token for token across
churn (staggered joins, different lengths, an abort mid-stream, preemption in a small pool),
engine calls run on the engine thread, a failed step fails only the streams of that moment,
and pools are empty afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading

import pytest

from services.engine import overlapped_steps as steps_module
from services.engine.sampling.params import SamplingParams
from services.worker.engine_loop import EngineLoop
from services.worker.outputs import merged_deltas
from tests.services.engine.device.test_cuda_graphs import with_static_path
from tests.services.engine.helpers import assert_pools_empty, make_engine, random_prompts, write_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("pair"))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def stream(
    loop: EngineLoop, rid: str, prompt: list[int], sampling: SamplingParams, stop_after: int = 0
):
    """The request's final output (None if it was left after ``stop_after`` outputs)."""
    submit = lambda: loop.engine.add_request(prompt, sampling, rid)  # noqa: E731
    async with contextlib.aclosing(loop.outputs(rid, submit)) as outputs:
        seen = 0
        async for out in outputs:
            seen += 1
            if out.finished:
                return out
            if stop_after and seen == stop_after:
                return None
    raise AssertionError("the stream ended without a finished output")


@pytest.mark.parametrize(("k", "overlap"), [(0, False), (2, False), (0, True), (2, True)])
def test_streams_equal_generate_across_churn(pair, k, overlap, monkeypatch):
    """``overlap``: decode steps through the (uncaptured) graph path, each launched before
    the previous one is read (overlapped_steps.py)."""
    successors = []
    launch, launch_spec = steps_module.launch, steps_module.launch_spec
    monkeypatch.setattr(steps_module, "launch", lambda *a: successors.append(len(a) > 3) or launch(*a))
    monkeypatch.setattr(
        steps_module, "launch_spec", lambda *a: successors.append(len(a) > 4) or launch_spec(*a)
    )
    prompts = random_prompts(8, seed=11, min_len=4, max_len=30)
    lengths = [5, 24, 9, 17, 24, 3, 12, 20]
    expected = make_engine(pair, k=k).generate(prompts, [greedy(n) for n in lengths])
    engine = make_engine(pair, k=k, num_pages=(24, 24), overlap=overlap)  # 96 tokens a group: preemption
    if overlap:
        with_static_path(engine)

    async def scenario():
        loop = EngineLoop(engine)
        loop.start()

        async def one(i: int):
            await asyncio.sleep(0.005 * max(0, i - 5))  # six at once, then joins during steps
            return await stream(loop, f"r{i}", prompts[i], greedy(lengths[i]), stop_after=3 if i == 4 else 0)

        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        await loop.call(assert_pools_empty, engine)  # the abort's pages too
        await loop.stop()
        return results

    results = asyncio.run(scenario())
    assert engine.scheduler.num_preemptions > 0  # the small pool preempted under load
    assert results[4] is None  # left mid-stream: aborted in the engine
    assert any(successors) == overlap
    for i, out in enumerate(results):
        if i != 4:
            assert out.token_ids == expected[i].token_ids, i


def test_engine_calls_run_on_the_engine_thread_and_not_after_stop(pair):
    engine = make_engine(pair, k=0)

    async def scenario():
        loop = EngineLoop(engine)
        loop.start()
        name = await loop.call(lambda: threading.current_thread().name)
        await loop.stop()
        with pytest.raises(RuntimeError, match="the engine loop stopped"):
            await loop.call(engine.num_requests)
        return name

    assert asyncio.run(scenario()) == "engine"


def test_a_failed_step_fails_the_streams_of_that_moment_and_the_loop_serves_on(pair, caplog):
    engine = make_engine(pair, k=2)
    expected = make_engine(pair, k=2).generate([[3, 1, 4, 1, 5]], greedy(8))[0]
    step, broken = engine.step, [True]

    def step_once_broken():
        if broken[0] and engine.num_requests()[0]:  # the first step with a running request
            broken[0] = False
            raise RuntimeError("boom")
        return step()

    engine.step = step_once_broken

    async def scenario():
        loop = EngineLoop(engine)
        loop.start()
        with pytest.raises(RuntimeError, match="engine step failed: boom"):
            await stream(loop, "a", [2, 7, 1, 8], greedy(8))
        after = await stream(loop, "b", [3, 1, 4, 1, 5], greedy(8))
        await loop.call(assert_pools_empty, engine)
        await loop.stop()
        return after

    assert asyncio.run(scenario()).token_ids == expected.token_ids
    assert [r.message for r in caplog.records if "engine step failed" in r.message] == [
        "engine step failed; failing its 1 requests"
    ]


def test_an_engine_thread_that_breaks_outside_a_step_ends_the_worker(pair, caplog):
    """Not a step's exception (those fail their requests): the thread cannot go on, so the
    worker must not stay up serving nothing; here ``on_fatal`` records instead of exiting."""
    engine = make_engine(pair, k=0)
    fatal: list[BaseException] = []

    def broken() -> bool:
        raise RuntimeError("lost the scheduler")

    async def scenario():
        loop = EngineLoop(engine)
        loop.on_fatal = fatal.append
        engine.has_unfinished = broken
        loop.start()
        await asyncio.to_thread(loop._thread.join, 5)
        return loop._thread.is_alive()

    assert asyncio.run(scenario()) is False
    assert [str(e) for e in fatal] == ["lost the scheduler"]
    assert [r.message for r in caplog.records if r.levelname == "CRITICAL"] == [
        "the engine thread failed; the worker exits"
    ]


@pytest.mark.parametrize("k", [0, 2])
def test_outputs_queued_while_the_reader_is_away_come_merged(pair, k):
    """A reader that falls behind (here: it waits for the request to finish before its second
    read) gets the queued delta outputs as one, with every token and logprob in order."""
    prompt = random_prompts(1, seed=5, min_len=9, max_len=9)[0]
    sampling = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
    expected = make_engine(pair, k=k).generate([prompt], [sampling])[0]
    engine = make_engine(pair, k=k, output_kind="delta")

    async def scenario():
        loop = EngineLoop(engine)
        loop.start()
        submit = lambda: engine.add_request(prompt, sampling, "r")  # noqa: E731
        reads = []
        async with contextlib.aclosing(loop.outputs("r", submit, merge=merged_deltas)) as outputs:
            async for out in outputs:
                reads.append(out)
                while await loop.call(lambda: "r" in engine.requests):
                    await asyncio.sleep(0.01)  # the engine steps on: the rest queues
        await loop.call(assert_pools_empty, engine)
        await loop.stop()
        return reads

    reads = asyncio.run(scenario())
    assert len(reads) <= 2  # the first output, then the other steps' as one
    assert reads[-1].finished and reads[-1].finish_reason == "length"
    assert [t for out in reads for t in out.token_ids] == expected.token_ids
    assert [t for out in reads for t in out.new_token_ids] == expected.token_ids
    logprobs = [e.logprob for out in reads for e in out.logprobs]
    assert logprobs == [e.logprob for e in expected.logprobs]
    untimed = lambda usage: dataclasses.replace(usage, queue_s=0.0)  # noqa: E731
    assert untimed(reads[-1].usage) == untimed(expected.usage)


def test_an_error_queued_after_outputs_is_raised_after_them(pair):
    engine = make_engine(pair, k=0, output_kind="delta")
    prompt = random_prompts(1, seed=6, min_len=5, max_len=5)[0]

    async def scenario():
        loop = EngineLoop(engine)
        loop.start()
        submit = lambda: engine.add_request(prompt, greedy(50), "r")  # noqa: E731
        tokens = []
        with pytest.raises(RuntimeError, match="worker draining"):
            async with contextlib.aclosing(loop.outputs("r", submit, merge=merged_deltas)) as outputs:
                async for out in outputs:
                    tokens += out.token_ids
                    if len(tokens) >= 3:
                        await loop.fail_all(RuntimeError("worker draining"))
        await loop.call(assert_pools_empty, engine)
        await loop.stop()
        return tokens

    tokens = asyncio.run(scenario())
    assert 3 <= len(tokens) < 50


def test_stepping_is_true_inside_a_step_only(pair):
    """What the transfers read to give the GIL up (kvcore.transfer.pacing)."""
    engine = make_engine(pair, k=0)
    step, seen = engine.step, []

    async def scenario():
        loop = EngineLoop(engine)

        def step_and_look():
            seen.append(loop.stepping)
            return step()

        engine.step = step_and_look
        loop.start()
        await stream(loop, "a", [2, 7, 1, 8], greedy(3))
        idle = loop.stepping
        await loop.stop()
        return idle

    assert asyncio.run(scenario()) is False
    assert seen and all(seen)


@pytest.mark.parametrize("k", [0, 2])
def test_delivered_outputs_equal_generate_across_churn_and_a_failing_sink_aborts(pair, k):
    """``delivered`` hands each delta output to a sink in the delivering callback: the
    tokens equal ``Engine.generate``'s across staggered joins and preemption; a sink that
    raises mid-request ends it with that error and frees its pages, as a cancelled wait does."""
    prompts = random_prompts(6, seed=12, min_len=4, max_len=30)
    lengths = [5, 24, 9, 17, 24, 12]
    expected = make_engine(pair, k=k).generate(prompts, [greedy(n) for n in lengths])
    engine = make_engine(pair, k=k, num_pages=(24, 24), output_kind="delta")

    async def scenario():
        loop = EngineLoop(engine)
        loop.start()
        tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

        def sink(i: int, out) -> None:
            tokens[i] += out.new_token_ids
            if i == 4 and len(tokens[i]) >= 3:
                raise ValueError("the stream closed")

        async def one(i: int):
            await asyncio.sleep(0.005 * max(0, i - 3))
            submit = lambda: engine.add_request(prompts[i], greedy(lengths[i]), f"r{i}")  # noqa: E731
            try:
                return await loop.delivered(f"r{i}", submit, lambda out: sink(i, out))
            except ValueError as e:
                return e

        async def cancelled():
            submit = lambda: engine.add_request(prompts[0], greedy(60), "c")  # noqa: E731
            task = asyncio.ensure_future(loop.delivered("c", submit, lambda out: None))
            await asyncio.sleep(0.05)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        results = await asyncio.gather(*(one(i) for i in range(len(prompts))), cancelled())
        await loop.call(assert_pools_empty, engine)  # the failed and the cancelled ones' pages too
        await loop.stop()
        return results[: len(prompts)], tokens

    results, tokens = asyncio.run(scenario())
    assert engine.scheduler.num_preemptions > 0
    assert str(results[4]) == "the stream closed" and 3 <= len(tokens[4]) < lengths[4]
    for i, out in enumerate(results):
        if i != 4:
            assert out.finished and tokens[i] == expected[i].token_ids, i
