"""Engine outputs as client protos, written once for the prefill, decode and aggregated
servicers: streamed chunks, usage and the completion.

A worker's engine gives "delta" outputs (services/worker/worker_config.py: each carries the
step's new token ids and logprobs alone). Token accounting: ``OutputStream.skip`` tokens at
the start of the request were delivered elsewhere (1 on the decode worker, whose first token
came with the prefill's answer) and are not streamed; ``streamed`` counts the tokens this
worker streamed, which the completion's ``completion_tokens`` reports (the router merges the
prefill's and the decode's usage). Outputs that queued while the stream was writing come
merged (``merged_deltas``): one chunk for several steps, so a busy event loop writes less.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from kvcore import TARGET_GROUP
from proto.tandem.v1 import client_pb2 as cpb
from services.engine.request import RequestOutput, TokenLogprob
from services.worker.engine_loop import EngineLoop

FINISH_REASONS = {
    "stop": cpb.FINISH_REASON_STOP,
    "length": cpb.FINISH_REASON_LENGTH,
    "abort": cpb.FINISH_REASON_ABORT,
    None: cpb.FINISH_REASON_UNSPECIFIED,
    "prefilled": cpb.FINISH_REASON_UNSPECIFIED,
}


@dataclass(slots=True)
class OutputStream:
    """One request's delta outputs as chunks; ``last`` is its final output once done."""

    skip: int = 0
    streamed: int = 0
    last: RequestOutput | None = None

    async def chunks(
        self, loop: EngineLoop, rid: str, submit: Callable[[], object]
    ) -> AsyncIterator[cpb.Chunk]:
        """Submit the request on the engine thread and yield a chunk per output that adds tokens."""
        async for out in loop.outputs(rid, submit, merge=merged_deltas):
            if (chunk := self._chunk(out)) is not None:
                yield chunk

    async def send(
        self, loop: EngineLoop, rid: str, submit: Callable[[], object], send: Callable[[cpb.Chunk], None]
    ) -> None:
        """Submit the request and ``send`` a chunk per output that adds tokens, as each
        step's outputs are delivered (no task woken per step: for a Steps stream's outbox,
        services/worker/step_streams.py); returns once the request finished. An exception
        from ``send`` ends the request and is raised here."""

        def sink(out: RequestOutput) -> None:
            if (chunk := self._chunk(out)) is not None:
                send(chunk)

        await loop.delivered(rid, submit, sink)

    def _chunk(self, out: RequestOutput) -> cpb.Chunk | None:
        """``out``'s tokens past ``skip`` as a chunk (None: it adds none); counts them."""
        self.last = out
        ids, logprobs = out.token_ids, out.logprobs
        if self.skip:
            n = min(self.skip, len(ids))
            ids, logprobs, self.skip = ids[n:], logprobs and logprobs[n:], self.skip - n
        if not ids:
            return None
        self.streamed += len(ids)
        return cpb.Chunk(token_ids=ids, logprobs=logprobs_to_proto(logprobs))

    def complete(self, prompt_tokens: int, cached: bool = True) -> cpb.Complete:
        """The final message: finish reason and usage (``cached``: report the prefix
        cache's hits, which only the worker that ran the prompt knows)."""
        out = self.last
        usage = speculation_usage(out, prompt_tokens, self.streamed)
        if cached:
            add_cached_tokens(usage, out.usage.cached_tokens)
        reason = FINISH_REASONS.get(out.finish_reason, cpb.FINISH_REASON_STOP)
        return cpb.Complete(finish_reason=reason, usage=usage)


def merged_deltas(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive "delta" outputs of one request as one: ``later``'s state (finish,
    usage: running totals) with both steps' tokens and logprobs."""
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = (earlier.logprobs or []) + (later.logprobs or [])
    return replace(
        later,
        new_token_ids=earlier.new_token_ids + later.new_token_ids,
        token_ids=earlier.token_ids + later.token_ids,
        logprobs=logprobs,
    )


def speculation_usage(out: RequestOutput, prompt_tokens: int, completion_tokens: int) -> cpb.Usage:
    u = out.usage
    return cpb.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        acceptance_length=u.acceptance_length,
        num_drafts=u.num_steps,
        num_draft_tokens=u.num_draft_tokens,
        num_accepted_tokens=u.num_accepted,
    )


def add_cached_tokens(usage: cpb.Usage, cached: dict[str, int]) -> cpb.Usage:
    """Prefix-cache hits per layer group; ``cached_tokens`` is the target's: that of its
    first group, ``TARGET_GROUP`` (a target of several groups reuses one match in all of
    them: kvcore's REQUIRED groups decide it together)."""
    usage.cached_tokens = cached.get(TARGET_GROUP, 0)
    usage.cached_tokens_per_group.extend(cpb.GroupTokens(group=g, num_tokens=n) for g, n in cached.items())
    return usage


def logprobs_to_proto(entries: list[TokenLogprob | None] | None) -> list[cpb.TokenLogprobs]:
    """Engine logprobs -> Chunk.logprobs (None entries, computed elsewhere, are skipped)."""
    return [
        cpb.TokenLogprobs(
            token_id=e.token_id, logprob=e.logprob, top_token_ids=e.top_ids, top_logprobs=e.top_logprobs
        )
        for e in entries or ()
        if e is not None
    ]
