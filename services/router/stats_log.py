"""The router's periodic stats line (``--log-stats-interval-s``, 0 = none):

    stats: running 3, waiting 1, ready pairs 2, workers 2 prefill / 2 decode / 0 aggregated,
    prompt 812.4 tok/s, generation 95.0 tok/s

``running``: requests admitted and not ended; ``waiting``: those not placed on a worker yet
(queued for pages or a pair). Tokens are counted when a request completes, so the rates
are those of the requests that ended since the last line. A line is written only while
requests run or wait, or when some ended since the last line: an idle router is quiet.
"""

from __future__ import annotations

import logging
import time

from proto.tandem.v1 import rank_info_pb2 as rpb
from services.router.api import RouterAPI

log = logging.getLogger("services.router.stats")


class RouterStatsLine:
    """One line per ``tick`` (services/common/periodic.py runs it)."""

    def __init__(self, router: RouterAPI) -> None:
        self.router = router
        self.last_totals = list(router.token_totals)
        self.last_time = time.monotonic()

    def tick(self) -> None:
        r, now = self.router, time.monotonic()
        totals, elapsed = list(r.token_totals), max(now - self.last_time, 1e-9)
        prompt, generated = (totals[i] - self.last_totals[i] for i in range(2))
        self.last_totals, self.last_time = totals, now
        running = len(r.flows)
        if not running and not prompt and not generated:
            return
        waiting = sum(not f.scheduled for f in r.flows.values())
        registry = r.cluster.registry
        roles = [len(registry.live_ids(role)) for role in (rpb.ROLE_PREFILL, rpb.ROLE_DECODE, rpb.ROLE_BOTH)]
        fields = {
            "running": running,
            "waiting": waiting,
            "ready_pairs": len(registry.ready_pairs()),
            "prefill_workers": roles[0],
            "decode_workers": roles[1],
            "aggregated_workers": roles[2],
            "prompt_tokens_per_s": round(prompt / elapsed, 1),
            "generation_tokens_per_s": round(generated / elapsed, 1),
        }
        log.info(
            "stats: running %d, waiting %d, ready pairs %d, workers %d prefill / %d decode / %d aggregated, "
            "prompt %.1f tok/s, generation %.1f tok/s",
            *fields.values(),
            extra={"fields": fields},
        )
