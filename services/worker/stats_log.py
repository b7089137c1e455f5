"""A worker's periodic stats line (``--log-stats-interval-s``, default 10 s, 0 = none):

    stats: running 3, waiting 1, KV target 41.2% draft 12.5% (prefix cache 8.0%),
    prompt 812.4 tok/s, generation 95.0 tok/s, AL 2.41

- ``running``/``waiting``: the engine's requests (a decode worker's reservations whose
  pages have not landed are neither);
- KV usage per layer group: pages in use (requests and the prefix cache) of the group's
  pool, and in brackets the share of the target's that only the prefix cache holds;
- prompt tok/s: prompts this worker ran (cached tokens included; none on a decode worker),
  counted at each prompt's first output; generation tok/s: every token it produced
  (services/worker/engine_loop.py); both since the last line;
- AL: tokens per verify step since the last line, over every origin; "-" when no
  speculative step ran.

Written only while requests run or wait, or when tokens were made since the last line:
an idle worker is quiet (vLLM logs while busy, alike).
"""

from __future__ import annotations

import logging
import time

from services.worker.worker import WorkerBase

log = logging.getLogger("services.worker.stats")


class WorkerStatsLine:
    """One line per ``tick`` (services/common/periodic.py runs it)."""

    def __init__(self, worker: WorkerBase) -> None:
        self.worker = worker
        self.last = self._totals()
        self.last_time = time.monotonic()

    def _totals(self) -> tuple[int, int, int, int]:
        """Prompt tokens, generated tokens, verify steps, accepted drafts: totals so far."""
        loop, stats = self.worker.loop, self.worker.engine.stats.values()
        steps = sum(s.num_steps for s in stats)
        return loop.prompt_tokens, loop.generated_tokens, steps, sum(s.num_accepted for s in stats)

    def tick(self) -> None:
        w, now, totals = self.worker, time.monotonic(), self._totals()
        prompt, generated, steps, accepted = (t - last for t, last in zip(totals, self.last, strict=True))
        elapsed = max(now - self.last_time, 1e-9)
        self.last, self.last_time = totals, now
        running, waiting = w.engine.num_requests()
        if not running and not waiting and not prompt and not generated:
            return
        usage = w.engine.cache_stats().usage
        kv = {g: round(100 * u.used / u.total, 1) if u.total else 0.0 for g, u in usage.items()}
        first = next(iter(usage.values()), None)
        cached = round(100 * first.cached / first.total, 1) if first is not None and first.total else 0.0
        al = (accepted + steps) / steps if steps else None
        fields = {
            "running": running,
            "waiting": waiting,
            "kv_usage_percent": kv,
            "prefix_cache_percent": cached,
            "prompt_tokens_per_s": round(prompt / elapsed, 1),
            "generation_tokens_per_s": round(generated / elapsed, 1),
            "acceptance_length": round(al, 3) if al is not None else None,
        }
        groups = " ".join(f"{g} {p:.1f}%" for g, p in kv.items())
        log.info(
            "stats: running %d, waiting %d, KV %s (prefix cache %.1f%%), prompt %.1f tok/s, "
            "generation %.1f tok/s, AL %s",
            running,
            waiting,
            groups,
            cached,
            fields["prompt_tokens_per_s"],
            fields["generation_tokens_per_s"],
            f"{al:.2f}" if al is not None else "-",
            extra={"fields": fields},
        )
