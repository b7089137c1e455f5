"""The engine's overlapped decode steps: which steps overlap, and the chain of launches.

With ``EngineConfig.overlap``, a decode step through the device-resident path may be
launched and left unread: before reading step n the engine launches step n + 1 from step
n's results on the device (``device/overlap.py`` for target-only steps,
``device/spec_overlap.py`` for drafting ones), then reads step n and moves its requests
along while the GPU runs n + 1. The next ``Engine.step`` call goes on from n + 1 the same
way, until the next step may differ; then the unread step is read alone and the scheduler
runs as without overlap. Every step is read before a step that is not overlapped is
scheduled, so the scheduler never sees an unread step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.engine.config import EngineConfig
from services.engine.device.adaptive_k import AdaptiveK, greedy_only
from services.engine.device.device_step import DevicePlan, device_step_fits
from services.engine.device.overlap import InFlight, launch, overlaps, read
from services.engine.device.spec_overlap import SpecInFlight, launch_spec, read_spec, spec_overlaps
from services.engine.progress import RequestProgress
from services.engine.request import Request, Status
from services.engine.runner import ModelRunner
from services.engine.scheduler import Scheduler


class OverlappedSteps:
    """``in_flight``: the step launched and not yet read, if any."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        scheduler: Scheduler,
        progress: RequestProgress,
        rule: Callable[[], AdaptiveK | None] = lambda: None,
    ) -> None:
        """``rule``: the engine's adaptive K rule as it is now (None: K every step)."""
        self.config, self.runner, self.scheduler, self.progress = config, runner, scheduler, progress
        self.rule = rule
        self.in_flight: InFlight | SpecInFlight | None = None
        # frees held until the step (then in flight) that may write their pages is read
        self.held: list[tuple[InFlight | SpecInFlight, str, list[int]]] = []
        progress.free_later = self._free_later

    def start(self, plan: DevicePlan, decode: list[Request], k: int) -> bool:
        """Run the step ``plan`` was made for overlapped, when it may: launch it, launch
        its successor, read it. Whether it ran (False: the caller runs it as usual)."""
        if not self._may_overlap(decode, k):
            return False
        self.in_flight = self._launch(plan, decode, k)
        if self.in_flight is None:
            return False
        self.go_on()
        return True

    def go_on(self) -> bool:
        """Read the in-flight step and move its requests along, launching its successor
        first when the next step may be launched unread (``_successor``); whether one was.
        A request finished (or aborted) since the step's launch drops its row."""
        step, self.in_flight = self.in_flight, None
        self.in_flight = self._successor(step)
        launched = self.in_flight is not None
        try:
            self._read(step)
        except BaseException:
            self._drop()  # its inputs came from a step not (wholly) applied
            raise
        if self.in_flight is not None and not self.in_flight.going_on():
            self.settle()  # every request it ran has finished: read it now, free their pages
        return launched

    def settle(self) -> None:
        """Read the unread step, if any, launching nothing after it."""
        step, self.in_flight = self.in_flight, None
        if step is not None:
            self._read(step)

    def _free_later(self, request_id: str, tokens: list[int]) -> bool:
        """Hold a finished request's free while a launched step may still write its pages
        (its row of that step); freed once that step is read (:meth:`_read`)."""
        if self.in_flight is None:
            return False
        self.held.append((self.in_flight, request_id, tokens))
        return True

    def holds(self, request_id: str) -> bool:
        """Whether a finished request's pages wait here for a launched step to be read."""
        return any(rid == request_id for _, rid, _ in self.held)

    def _drop(self) -> None:
        """Drop the unread step after a failure: wait for the device to pass every launched
        step, then free every held request's pages."""
        self.in_flight = None
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        self._free_held(None)

    def _free_held(self, step: InFlight | SpecInFlight | None) -> None:
        """Free the pages held for ``step`` (None: all)."""
        manager, kept = self.scheduler.manager, []
        for held in self.held:
            if step is None or held[0] is step:
                manager.free(held[1], held[2])
            else:
                kept.append(held)
        self.held = kept

    def _read(self, step: InFlight | SpecInFlight) -> None:
        """Read ``step`` and move along its requests that still decode. An unread step
        dropped instead leaves the host's state at the step before it, which is exact: a
        request's state only ever moves by a read step, and the next step rewrites the KV
        the dropped one wrote."""
        result = read_spec(step) if isinstance(step, SpecInFlight) else read(step)
        self._free_held(step)  # read: the step writes no more
        for i, req in enumerate(step.decode):
            if req.status is Status.DECODE:
                self.progress.advance_decode(req, result, i)

    def _may_overlap(self, decode: list[Request], k: int) -> bool:
        """Asked for; target-only steps of requests that overlap (``overlap.overlaps``), or
        drafting steps of the chain's K (``spec_overlap.spec_overlaps``)."""
        if not self.config.overlap:
            return False
        if self.runner.drafter is None:
            return not k and all(map(overlaps, decode))
        chain = self.runner.graphs.chain
        return bool(k) and chain is not None and k == chain.k and all(spec_overlaps(r, k) for r in decode)

    def _launch(
        self, plan: DevicePlan, decode: list[Request], k: int, after: InFlight | SpecInFlight | None = None
    ) -> InFlight | SpecInFlight | None:
        if k:
            return launch_spec(plan.graphs, plan, decode, self.config.forced_acceptance, after)
        return launch(plan.graphs, plan, decode, after)

    def _successor(self, step: InFlight | SpecInFlight) -> InFlight | SpecInFlight | None:
        """The step after ``step``, launched before ``step`` is read: ``step``'s requests
        that still decode and those that joined the running list after them since (a
        transfer landed). None when the next step may differ: one more may be admitted, a
        request is not decoding or no longer overlaps, or the pages for the step do not fit
        (the scheduler preempts then)."""
        s, spec = self.scheduler, isinstance(step, SpecInFlight)
        if s.waiting and len(s.running) < s.max_num_seqs:
            return None
        going_on = [step.decode[i] for i in step.going_on()]
        decode, went_on = list(s.running), len(going_on)
        if len(decode) < went_on:
            return None
        if any(a is not b for a, b in zip(decode, going_on, strict=False)):
            return None
        k = step.k if spec else 0
        fits = (lambda r: spec_overlaps(r, k)) if spec else overlaps
        if not decode or not all(r.status is Status.DECODE and fits(r) for r in decode):
            return None
        rule = self.rule() if spec and greedy_only(decode) else None
        if rule is not None and rule.choose(len(decode)) < k:
            return None  # the rule would not draft this step: it runs as it says
        manager = self.scheduler.manager
        ids = [r.request_id for r in decode]
        ends = [r.num_computed + (k + 1 if i < went_on else 0) for i, r in enumerate(decode)]
        if not manager.can_extend_batch(ids, ends):
            return None
        manager.extend_batch(ids, ends)
        plan = device_step_fits(self.runner, decode, k)
        return self._launch(plan, decode, k, step) if plan is not None else None
