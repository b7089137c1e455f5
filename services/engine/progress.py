"""How a step's results move its requests along.

Per request (positions as in ``request.py``):
- a prefill chunk ending at e makes the target's KV valid on [0, e) (the drafter's too,
  when there is one); the last chunk's logits give t_n, and the request decodes, or parks
  with its ``AuxState`` when it is prefill-only;
- a verify step that accepts a of the drafts emits a + 1 tokens: num_computed grows by
  a + 1 and those tokens (with their target features) are the drafter's next pending
  inputs; a step whose catch-up was left for later (``caught_up`` False) appends them to
  the pending ones instead, and the drafter's exact prefix stays where it was;
- after each, the cache is told how far KV is final, and a request that met a stop rule
  ends: its pages are freed (offered to the prefix cache; once no launched step may still
  write them, with overlapped steps) and its final output is queued.
A request with a grammar feeds its matcher every token appended (and only those), so the
matcher's state is always its output's; the grammar's end (an EOS it took, even under
``ignore_eos``) or a token it refused ends the request with reason "stop".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcore import AuxState, KVCacheManager
from services.engine.batch import StepResult, TargetRun
from services.engine.request import PrefillSpan, Request, Status, TokenLogprob
from services.engine.scheduler import Scheduler
from services.engine.stats import SpecStats
from services.engine.step_outputs import StepOutputs


class RequestProgress:
    """``requests``: the engine's table, from which finished requests are dropped;
    ``drafting``: a drafter runs (its KV follows the target's)."""

    def __init__(
        self,
        manager: KVCacheManager,
        scheduler: Scheduler,
        out: StepOutputs,
        requests: dict[str, Request],
        drafting: bool,
    ) -> None:
        self.manager, self.scheduler, self.out, self.requests = manager, scheduler, out, requests
        self.drafting = drafting
        self.stats: dict[str, SpecStats] = {}  # speculative counters per origin
        # takes a finished request's free (id, cacheable tokens) while a launched step may
        # still write its pages, returning True; None or False: free now (overlapped_steps.py)
        self.free_later: Callable[[str, list[int]], bool] | None = None

    def chunks_ran(
        self, prefill: list[tuple[Request, PrefillSpan]], run: TargetRun, offsets: list[int]
    ) -> None:
        """Record the prefill chunks' KV (request i's rows: offsets[i]:offsets[i + 1])."""
        for i, (req, span) in enumerate(prefill):
            req.prefill_pos = span.end
            req.num_computed = max(req.num_computed, span.end)
            req.draft_valid = span.end if self.drafting else req.num_computed
            if run.features is not None:
                req.last_feature = run.features[offsets[i + 1] - 1]
            self.release_window(req)

    def start_decode(self, req: Request, token: int, logprobs: list[TokenLogprob]) -> None:
        """A finished prefill sampled ``token`` (t_n): decode, or park a prefill-only request."""
        n = req.num_computed
        req.forced_first = None  # a re-prefill after a preemption samples its next token
        req.pending_start, req.pending_tokens = n, [token]
        if req.last_feature is not None:
            req.pending_features = [req.last_feature[None]]
        if req.prefill_only:
            req.output_ids.append(token)
            req.output_logprobs.extend(logprobs)
            req.status = Status.PARKED
            hidden = req.last_feature.float().cpu() if req.last_feature is not None else torch.zeros(0)
            req.aux = AuxState(n, token, hidden)
            self.scheduler.remove(req)
            self.out.park(req)
            return
        req.status = Status.DECODE
        self.append(req, [token], logprobs)
        if req.finish_reason is not None:
            self.finish(req)

    def start_prefilled(self, req: Request, aux: AuxState, hidden: torch.Tensor) -> None:
        """A request whose prompt KV was transferred decodes from t_n (``aux``);
        ``hidden`` [1, hidden_size]: f_{n-1} on the engine's device."""
        n = aux.prompt_len
        req.status = Status.DECODE
        req.num_computed = req.target_write_start = req.draft_valid = n
        req.pending_start, req.pending_tokens, req.pending_features = n, [aux.first_token_id], [hidden]
        self.requests[req.request_id] = req
        self.append(req, [aux.first_token_id], [None])
        if req.finish_reason is not None:
            self.finish(req)
            return
        self.scheduler.add_running(req)

    def advance_decode(self, req: Request, step: StepResult, i: int) -> None:
        """``req`` is request i of a verify step that emitted ``step.emitted[i]``
        (accepted drafts, then one more); its target rows are ``step.offsets[i]`` ..
        ``step.offsets[i + 1]`` (its drafts verified, + 1)."""
        emitted, logprobs, run = step.emitted[i], step.logprobs[i], step.run
        rows = range(step.offsets[i], step.offsets[i + 1])
        n, a, row = req.num_computed, len(emitted) - 1, rows.start
        req.spec.record(len(rows) - 1, a)
        self.stats.setdefault(req.origin, SpecStats()).record(len(rows) - 1, a)
        self.append(req, emitted, logprobs)
        req.num_computed = n + a + 1
        features = run.features[row : row + a + 1] if run.features is not None else None
        if not step.caught_up:  # slots [pending_start, n] still wait for the drafter
            req.pending_tokens = req.pending_tokens + emitted
            if features is not None:
                req.pending_features = [*req.pending_features, features]  # one cat at the catch-up
        else:
            req.pending_start, req.pending_tokens = n + 1, emitted
            if features is not None:
                req.pending_features = [features]
            req.draft_valid = n + 1 if self.drafting else req.num_computed
        self.release_window(req)
        if req.finish_reason is not None:
            self.finish(req)

    def append(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob | None]) -> None:
        """Append under the stop rules, with the logprobs of the tokens kept."""
        before = len(req.output_ids)
        grammar = req.grammar
        if grammar is not None:
            tokens = grammar.cut(tokens)
        self.out.append(req, tokens)
        if grammar is not None and req.finish_reason is None:
            took = grammar.feed(req.output_ids)
            if not took or req.output_ids[-1] in grammar.eos_ids:
                req.finish_reason = "stop"
        if req.sampling.logprobs is not None:
            req.output_logprobs.extend(logprobs[: len(req.output_ids) - before])

    def release_window(self, req: Request) -> None:
        """Tell the manager how far KV is final. We report the page-aligned exact prefix,
        not num_computed: the prefix cache keeps whole pages up to there, and the draft
        window ending at that point must still be held for it to be reusable."""
        page = self.manager.tokens_per_page
        self.manager.advance(req.request_id, req.cacheable_len // page * page)

    def finish(self, req: Request) -> None:
        """End ``req``: free its pages (offering its exact prefix to the cache), queue its output."""
        if self.manager.has_request(req.request_id):
            tokens = req.tokens[: req.cacheable_len]
            if self.free_later is None or not self.free_later(req.request_id, tokens):
                self.manager.free(req.request_id, tokens)
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        self.out.finish(req)
        del self.requests[req.request_id]
