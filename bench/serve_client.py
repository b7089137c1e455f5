"""Streaming gRPC clients of ``tandem.v1.Tandem/Generate`` for the served-load sweep.

A :class:`Load` is what one client process sends: token-id prompts, greedy, ``ignore_eos``
(optionally constrained by a regular expression),
``max_tokens`` each, either closed loop (``concurrency`` streams, each sending its next
prompt when its last one ended) or open loop (prompt i sent at ``start + arrivals[i]``).
:func:`split` spreads a point over several processes (so that the client's Python is not
what limits 128 streams); :func:`run_load` runs one process's share and returns a
:class:`RequestRecord` per request. A request counts as failed (``error`` set) when the
RPC fails, an ``error`` message comes, it finishes other than by length, or its token
counts are not exact (:func:`count_error`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, replace

import grpc

from bench.serve_stats import RequestRecord, Transfer
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc


@dataclass(frozen=True, slots=True)
class Load:
    """``concurrency`` > 0: closed loop; else open loop at ``arrivals`` (seconds after
    ``start``, one per prompt). ``start``: ``time.monotonic()`` at which sending begins."""

    address: str
    prompts: list[list[int]]
    max_tokens: int
    concurrency: int = 0
    arrivals: tuple[float, ...] = ()
    start: float = 0.0
    timeout_s: float = 600.0
    structured_regex: str = ""  # every request's output constrained to it; "" = unconstrained


def split(load: Load, processes: int) -> list[Load]:
    """``load`` over at most ``processes`` shares. Closed loop: stream s lives in process
    s % processes and sends prompts s, s + C, ...; open loop: prompt i goes to process
    i % processes at its own arrival time. Shares with nothing to send are dropped."""
    shares, n = [], len(load.prompts)
    for p in range(processes):
        if load.concurrency:
            mine = [i for i in range(n) if i % load.concurrency % processes == p]
            streams, arrivals = len(range(p, load.concurrency, processes)), ()
        else:
            mine = list(range(p, n, processes))
            streams, arrivals = 0, tuple(load.arrivals[i] for i in mine)
        if mine:
            prompts = [load.prompts[i] for i in mine]
            shares.append(replace(load, prompts=prompts, concurrency=streams, arrivals=arrivals))
    return shares


def run_load(load: Load) -> list[RequestRecord]:
    """Send ``load`` (in this process) and return its records, in no particular order."""
    return asyncio.run(_run(load))


async def _run(load: Load) -> list[RequestRecord]:
    async with grpc.aio.insecure_channel(load.address) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=30)
        stub = cpb_grpc.TandemStub(channel)
        await asyncio.sleep(max(0.0, load.start - time.monotonic()))
        if load.concurrency:
            return await _closed(stub, load)
        return await _open(stub, load)


async def _closed(stub: cpb_grpc.TandemStub, load: Load) -> list[RequestRecord]:
    queue, records = deque(load.prompts), []

    async def stream() -> None:
        while queue:
            records.append(await request(stub, queue.popleft(), load))

    await asyncio.gather(*(stream() for _ in range(load.concurrency)))
    return records


async def _open(stub: cpb_grpc.TandemStub, load: Load) -> list[RequestRecord]:
    async def at(prompt: list[int], offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, load.start + offset - time.monotonic()))
        return await request(stub, prompt, load)

    return list(await asyncio.gather(*(at(p, t) for p, t in zip(load.prompts, load.arrivals, strict=True))))


async def request(stub: cpb_grpc.TandemStub, prompt: list[int], load: Load) -> RequestRecord:
    """One streaming Generate of ``load``'s kind, greedy with ``ignore_eos``; never raises for
    a failed RPC."""
    max_tokens = load.max_tokens
    sampling = cpb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    if load.structured_regex:
        sampling.structured.regex = load.structured_regex
    message = cpb.GenerateRequest(token_ids=cpb.TokenIds(ids=prompt), sampling=sampling)
    record = RequestRecord(sent=time.monotonic(), prompt_tokens=len(prompt))
    try:
        async for response in stub.Generate(message, timeout=load.timeout_s):
            take(record, response, time.monotonic())
    except grpc.aio.AioRpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    if record.end != record.end:  # NaN: no complete message came
        record.end = time.monotonic()
    record.error = record.error or count_error(record, max_tokens)
    return record


def count_error(record: RequestRecord, max_tokens: int) -> str:
    """What is wrong with the token counts of a request that otherwise succeeded ("" if
    nothing): streamed tokens and Usage.completion_tokens must both be ``max_tokens``, and
    Usage.prompt_tokens the prompt's length."""
    counts = (record.tokens, record.usage_completion_tokens, record.usage_prompt_tokens)
    if counts == (max_tokens, max_tokens, record.prompt_tokens):
        return ""
    return (
        f"{record.tokens} tokens streamed, usage {record.usage_completion_tokens} completion and "
        f"{record.usage_prompt_tokens} prompt tokens; asked for {max_tokens} after {record.prompt_tokens}"
    )


def take(record: RequestRecord, response: cpb.GenerateResponse, now: float) -> None:
    """Fold one streamed message into ``record`` (arrival time ``now``)."""
    kind = response.WhichOneof("payload")
    if kind == "chunk" and response.chunk.token_ids:
        record.chunk_times.append(now)
        record.tokens += len(response.chunk.token_ids)
    elif kind == "error":
        record.error = record.error or f"error message: {response.error.message}"
    elif kind == "complete":
        record.end = now
        usage = response.complete.usage
        record.usage_prompt_tokens, record.usage_completion_tokens = (
            usage.prompt_tokens,
            usage.completion_tokens,
        )
        record.acceptance_length, record.decode_steps = usage.acceptance_length, usage.num_drafts
        record.transfers = [Transfer(t.group, t.num_bytes, t.seconds) for t in usage.transfers]
        reason = response.complete.finish_reason
        if reason != cpb.FINISH_REASON_LENGTH and not record.error:
            record.error = f"finished {cpb.FinishReason.Name(reason)}"
