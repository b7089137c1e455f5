"""``n`` > 1: one OpenAI request answered by n requests to the workers, one per choice.

Choice i is the parent request with the router id ``<id>-<i>`` (the response keeps the
parent's id) and, when the request is seeded, the seed + i (mod 2^64): its answer is then
exactly what a single request with that seed answers. Unseeded choices each get a fresh
seed; greedy ones are all the same answer (as vLLM). Choice 0 starts first and the others
once its first token came: disaggregated, its prefill worker has by then released the
prompt's pages into its prefix cache, and the others' prefill reuses them (an aggregated
worker offers pages to its cache when a request finishes, so there each choice prefills).

Usage counts the prompt once and the completion tokens of every choice; the rest of it
(cached tokens, Tandem's speculation and transfer figures) is choice 0's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace

from proto.tandem.v1 import client_pb2 as cpb
from services.router.openai_protocol import OpenAIRequest

SEED_MOD = 2**64


def choice_requests(request: OpenAIRequest) -> list[OpenAIRequest]:
    """The n requests answering ``request``'s n choices, in choice order."""
    rid = request.generate.request_id
    out = []
    for i in range(request.n):
        generate = cpb.GenerateRequest()
        generate.CopyFrom(request.generate)
        generate.request_id = f"{rid}-{i}"
        if generate.sampling.HasField("seed"):
            generate.sampling.seed = (generate.sampling.seed + i) % SEED_MOD
        out.append(replace(request, generate=generate, n=1, index=i, response_id=rid))
    return out


def merged_usage(usages: list[cpb.Usage]) -> cpb.Usage:
    """Choice 0's usage with every choice's completion tokens."""
    usage = cpb.Usage()
    usage.CopyFrom(usages[0])
    usage.completion_tokens = sum(u.completion_tokens for u in usages)
    return usage


def merged_payload(payloads: list[dict], rid: str) -> dict:
    """One response body of the choices' bodies (each with its one choice, in order)."""
    usage = dict(payloads[0]["usage"])
    usage["completion_tokens"] = sum(p["usage"]["completion_tokens"] for p in payloads)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    body = {**payloads[0], "id": rid, "usage": usage}
    body["choices"] = [{**p["choices"][0], "index": i} for i, p in enumerate(payloads)]
    return body


async def interleaved(streams: list[AsyncIterator[bytes]]) -> AsyncGenerator[bytes, None]:
    """Every stream's events as they come, until all have ended; one that raises stops all
    (the error propagates). The streams are closed by their owners."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[bytes]) -> None:
        try:
            async for event in stream:
                await queue.put(event)
        except Exception as e:  # handed to the consumer
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
