"""When drafting pays: each decode step runs either the engine's K drafts or none.

The rule, from measured step costs and the running acceptance:
- per batch bucket b the engine keeps t_spec(b) and t_plain(b), the wall time (seconds)
  of its steps with K drafts and with none: the least of the last ``window`` steps of that
  kind. A step ends with its host read of the emitted tokens, so its wall time is its
  whole cost, and noise only ever adds to it (a collection pause, a first call, another
  process on the host): the least recent time is the cost, and one slow step cannot
  stop drafting for the many steps an average would take to forget it;
- AL is the running mean of tokens emitted per request in a speculative step (accepted
  drafts + 1), over all buckets;
- a speculative step makes AL tokens per request in t_spec(b), a plain one 1 in t_plain(b):
  draft iff AL * t_plain(b) >= t_spec(b).
The first step of each kind in a bucket is not counted (a first replay or a first eager
shape costs more than the steady state). Until both costs of a bucket are measured the
step drafts, then it runs one step without drafts; after ``probe_every`` steps of
one kind in a bucket, one step of the other kind refreshes its cost (and AL), so the choice
follows the context length and the acceptance as they move.

Either choice keeps the output lossless: a plain step is the target's own sampling, and
the drafter's catch-up forward runs on it or, while the pending slots fit the longest
graphed catch-up (``device_step.lags_catch_up``), on the next step that drafts, so its KV
is exact whenever it drafts. A plain step's measured cost includes the catch-ups it runs,
and a drafting step's the lagged catch-up it runs. The rule applies
to batches of greedy requests only (``greedy_only``), whose output is token-for-token the
same whatever it picks: a seeded sampled request must draw the same tokens whatever the
step timings were, and a step with drafts turns its draws into tokens differently (through
the drafter's q and the residual) from a step without.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.engine.device.graphed_forward import batch_buckets
from services.engine.request import Request


def greedy_only(requests: list[Request]) -> bool:
    """Whether no request of the batch samples: the K rule may then choose, since greedy
    output does not depend on K."""
    return all(r.sampling.greedy for r in requests)


@dataclass(slots=True)
class BucketCosts:
    window: int = 8
    spec_times: deque[float] = field(default_factory=deque)  # seconds of recent steps with K drafts
    plain_times: deque[float] = field(default_factory=deque)  # ... and without drafts
    run: int = 0  # steps of the current kind in a row
    spec: bool = True  # the current kind
    seen: set[bool] = field(default_factory=set)  # kinds whose first (uncounted) step ran

    @property
    def spec_s(self) -> float:
        """Seconds a step with K drafts costs, 0 = not measured yet."""
        return min(self.spec_times, default=0.0)

    @property
    def plain_s(self) -> float:
        """Seconds a step without drafts costs, 0 = not measured yet."""
        return min(self.plain_times, default=0.0)

    def add(self, spec: bool, seconds: float) -> None:
        times = self.spec_times if spec else self.plain_times
        times.append(seconds)
        if len(times) > self.window:
            times.popleft()


@dataclass(slots=True)
class AdaptiveK:
    """The per-step choice of K (``k`` or 0) for the engine's decode batches."""

    k: int
    max_batch: int
    probe_every: int = 32
    smoothing: float = 0.2  # weight of the newest step in AL's moving average
    window: int = 8  # recent steps per kind and bucket whose least time is the cost
    al: float = 0.0  # running tokens per request per speculative step, 0 = none yet
    costs: dict[int, BucketCosts] = field(default_factory=dict)
    spec_steps: int = 0  # steps recorded with drafts, all buckets
    plain_steps: int = 0  # steps recorded without

    def choose(self, batch: int) -> int:
        """The drafts per request for the next step of ``batch`` requests: k or 0."""
        c = self.costs.setdefault(self.bucket(batch), BucketCosts(self.window))
        if not c.spec_s or not self.al:
            return self.k
        if not c.plain_s:
            return 0
        spec = self.al * c.plain_s >= c.spec_s  # drafting pays
        if c.run >= self.probe_every and spec == c.spec:
            spec = not spec  # probe the other kind
        return self.k if spec else 0

    def record(self, batch: int, k: int, seconds: float, tokens: int) -> None:
        """A decode step of ``batch`` requests with ``k`` drafts each took ``seconds`` of
        wall time and emitted ``tokens`` tokens."""
        c = self.costs.setdefault(self.bucket(batch), BucketCosts(self.window))
        spec = k > 0
        c.run = c.run + 1 if spec == c.spec else 1
        c.spec = spec
        self.spec_steps += spec
        self.plain_steps += not spec
        if spec not in c.seen:
            c.seen.add(spec)
            return
        c.add(spec, seconds)
        if spec:
            self.al = self._mean(self.al, tokens / batch)

    def bucket(self, batch: int) -> int:
        return next((b for b in batch_buckets(self.max_batch) if b >= batch), batch)

    def _mean(self, mean: float, value: float) -> float:
        return value if not mean else (1 - self.smoothing) * mean + self.smoothing * value
