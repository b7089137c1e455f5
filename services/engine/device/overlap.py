"""Overlapped decode steps: step n + 1 is launched before step n is read.

A target-only step (no drafter) on the graphed one-token forward samples each request's
next token on the device. Its successor needs only that token as input: its positions,
slots and block tables follow from the host's state (one token more per request), so the
host can queue step n + 1 behind step n and read step n while the GPU runs n + 1. The
host's bookkeeping of step n (stop rules, outputs, the next launch's inputs) then runs
beside the GPU's work instead of after it.

Per step, in stream order: the graph's upload of positions, slots and tables; for a
successor, a device copy of its predecessor's tokens over the uploaded ids; the replay;
the verdict (greedy: the argmax; sampled: the same keyed draws as ``device_step``) into a
tensor of its own [batch]; its copy to host memory and an event. Reading a step waits on
that event alone, never on the successor queued behind it.

A request that finishes at step n (a stop token, its length, an abort) was also run by
step n + 1: that row's token is dropped when n + 1 is read, and the KV it wrote lies past
the request's cacheable prefix. Its pages are freed once n + 1 is read
(``overlapped_steps.OverlappedSteps.held``), so nothing else gets a page it may still write.

Who takes part: requests whose tokens the device picks alone (``device_step.on_device``).
Logprobs, when asked for, are computed on the device before step n + 1's replay overwrites
step n's logits (``overlap_logprobs.py``). Any other batch runs a step and reads it at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.batch import Span, StepResult, TargetRun
from services.engine.device.cuda_graphs import DecodeGraphs
from services.engine.device.device_step import DevicePlan, on_device, sampled_next
from services.engine.device.overlap_logprobs import QueuedLogprobs, pinned_copy, queue_logprobs, step_logprobs
from services.engine.request import Request, Status
from services.engine.sampling.row_sampling import to_device


@dataclass(slots=True)
class InFlight:
    """A launched step not yet read: ``decode``'s next tokens, on the device and (once
    ``ready``) on the host."""

    decode: list[Request]
    tokens: torch.Tensor  # [batch] int64 on the device: each request's next token
    host: torch.Tensor  # [batch] int64 host copy (pinned on CUDA), valid once `ready` is reached
    ready: torch.cuda.Event | None  # recorded after the host copies; None off CUDA (copies are synchronous)
    run: TargetRun  # the forward's hidden rows (copies); its logits are not kept
    logprobs: QueuedLogprobs | None = None  # of the requests that ask for them

    def going_on(self) -> list[int]:
        """The rows whose request still decodes: not finished or aborted since the launch."""
        return [i for i, r in enumerate(self.decode) if r.status is Status.DECODE]


def overlaps(req: Request) -> bool:
    """Whether ``req`` may run in an overlapped step: the device picks its tokens alone."""
    return on_device(req, 0)


@torch.inference_mode()
def launch(
    graphs: DecodeGraphs, plan: DevicePlan, decode: list[Request], after: InFlight | None = None
) -> InFlight | None:
    """Queue a target-only step over ``decode`` without reading it, each request from its
    last token at position num_computed. With ``after``, the step after it: ``decode``
    starts with ``after``'s requests that still decode (``going_on``), in its order, which
    go on from ``after``'s tokens (on the device) at num_computed + 1, in pages the caller
    has extended; the requests past them joined since (a transfer landed) start as without
    ``after``. None when the batch does not fit the one-token graph."""
    ids, went_on = successor_ids(after)
    starts = [r.num_computed + (i < went_on) for i, r in enumerate(decode)]
    spans = [
        Span(r.request_id, n, [r.last_token], r.target_write_start)
        for r, n in zip(decode, starts, strict=True)
    ]
    run = graphs.run_verify(spans, plan.target_tables, ids)
    if run is None:
        return None
    tokens = next_tokens(decode, run, starts)
    logprobs = queue_logprobs(decode, run.logits[:, None], tokens[:, None])
    return InFlight(decode, tokens, *host_copy(tokens), TargetRun(run.hidden, run.features), logprobs)


def host_copy(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy of ``values`` queued in stream order, and the event that says it (and
    every copy queued before it) is there (None off CUDA, where copies are done on return)."""
    host = pinned_copy(values)
    if values.device.type != "cuda":
        return host, None
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def successor_ids(after: InFlight | None) -> tuple[torch.Tensor | None, int]:
    """The input ids [m] (device) of the rows that go on from ``after``, and m: its tokens,
    less the rows of requests that left since (a gather, its index sent without a wait)."""
    if after is None:
        return None, 0
    keep = after.going_on()
    if len(keep) == len(after.decode):
        return after.tokens, len(keep)
    if not keep:
        return None, 0
    index = to_device(torch.tensor(keep), after.tokens.device)
    return after.tokens.index_select(0, index), len(keep)


def next_tokens(decode: list[Request], run: TargetRun, starts: list[int]) -> torch.Tensor:
    """[batch] int64 on the device: each request's token after the step's one position
    (``starts``), as ``device_step`` picks it: the graph's argmax for a greedy batch, else
    the keyed draw from the request's transforms. A copy: the graph's outputs are
    overwritten by its next replay."""
    if all(r.sampling.greedy for r in decode):
        return run.verdict[:, 1].clone()  # [batch]: q_len 1, so row i is request i's
    return sampled_next(decode, run.logits.float(), starts)  # logits [batch, V]


def read(step: InFlight) -> StepResult:
    """Wait for ``step``'s tokens (not for what was queued after it) and give them as the
    general path's results: one token per request, and its logprobs when asked for."""
    if step.ready is not None:
        step.ready.synchronize()
    emitted = [[t] for t in step.host.tolist()]
    logprobs = step_logprobs(step.logprobs, step.decode, emitted)
    return StepResult(emitted, logprobs, step.run, list(range(len(emitted) + 1)))
