"""Continuous batching with chunked prefill and admission by free pages.

Each step, in order: running decode requests (K + 1 tokens each), running prefills (one
chunk each), then new admissions from the FIFO queue while pages, sequence slots and the
token budget last. Pages are checked before they are taken (``can_allocate`` /
``can_extend``). When a running request cannot grow, the most recently admitted request is
preempted: its exact prefix goes to the prefix cache, its pages are freed and it re-enters
the queue at the front, to be re-prefilled over prompt + output so far. Nothing crashes
for lack of pages; a request that cannot fit even an empty cache is refused at admission
time by the engine.
"""

from __future__ import annotations

import time
from collections import deque

from kvcore import DRAFT_GROUP, KVCacheManager
from services.engine.request import PrefillSpan, Request, Status, StepPlan


class Scheduler:
    def __init__(
        self,
        manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_chunk: int,
        num_spec_tokens: int,
        feeds_drafter: bool,
    ) -> None:
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.verify_len = num_spec_tokens + 1
        self.feeds_drafter = feeds_drafter  # re-run one position before a hit for features
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """A request whose pages are already allocated and filled (transferred)."""
        self.running.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if (
                req.status is Status.DECODE
                and req in self.running
                and self._ensure_pages(req, req.num_computed, plan)
            ):
                plan.decode.append(req)
                budget -= self.verify_len
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not Status.PREFILL or req not in self.running:
                continue
            end = min(req.prefill_end, req.prefill_pos + min(budget, self.max_prefill_chunk))
            if self._ensure_pages(req, end, plan):
                plan.prefill.append((req, PrefillSpan(req.prefill_pos, end)))
                budget -= end - req.prefill_pos
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            span = self._admit(self.waiting[0], budget)
            if span is None:
                break
            req = self.waiting.popleft()
            if not req.queue_s:  # the first admission; a preempted request waits again
                req.queue_s = time.monotonic() - req.arrival_s
            self.running.append(req)
            plan.prefill.append((req, span))
            budget -= span.end - span.start
        return plan

    def _admit(self, req: Request, budget: int) -> PrefillSpan | None:
        """Allocate the first chunk's pages (prefix hit included) or return None."""
        tokens = req.tokens
        match = self.manager.match_prefix(tokens)
        hit = match.num_tokens
        start = max(0, match.recompute_start - 1) if self.feeds_drafter else hit
        end = min(len(tokens), start + min(budget, self.max_prefill_chunk))
        alloc = max(end, hit + 1)
        if not self.manager.can_allocate(alloc, match):
            return None
        self.manager.allocate(req.request_id, alloc, match)
        req.reset_kv_state()
        if not req.cached_tokens:  # the first admission's: a re-admission's match covers output
            req.cached_tokens = {
                g: hit if s == hit else 0  # reused per group, as GroupStats
                for g, s in match.compute_start.items()
            }
        req.status = Status.PREFILL
        req.prefill_pos, req.prefill_end = start, len(tokens)
        req.num_computed = req.target_write_start = hit
        req.draft_write_start = match.compute_start.get(DRAFT_GROUP, hit)
        req.draft_valid = hit if not self.feeds_drafter else req.draft_write_start
        return PrefillSpan(start, end)

    def _ensure_pages(self, req: Request, num_tokens: int, plan: StepPlan) -> bool:
        """Extend ``req`` to cover [0, num_tokens + headroom), preempting from the back of
        the running list while pages are short. False if ``req`` itself was preempted."""
        while not self.manager.can_extend(req.request_id, num_tokens):
            victim = self.running[-1]
            self.preempt(victim, plan)
            if victim is req:
                return False
        self.manager.extend(req.request_id, num_tokens)
        return True

    def preempt(self, req: Request, plan: StepPlan) -> None:
        self.manager.free(req.request_id, req.tokens[: req.cacheable_len])
        self.running.remove(req)
        if req in plan.decode:
            plan.decode.remove(req)
        plan.prefill = [(r, s) for r, s in plan.prefill if r is not req]
        req.reset_kv_state()
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        plan.preempted.append(req)
        self.num_preemptions += 1
