"""The router's line per finished request (and per refused one).

One line per request, written once, when it ends (services/router/api.py):

    request cmpl-7 stop: prompt 12 (cached 4), completion 24 tokens, ttft 0.081 s, e2e 0.412 s,
    AL 2.40, prefill-0 -> decode-1

- ``stop``/``length`` (and ``abort``: the client aborted, ``cancelled``: its connection went)
  are INFO lines, left out with ``--disable-log-requests``;
- a failed request (an error message, a lost worker, a shutdown cut) is one WARNING line
  naming its cause, whatever that flag says: no other line reports the same failure;
- a refused one (bad field, busy id, not admitting) is an INFO line with the refusal.

The JSON format carries the same fields as keys (``extra`` ``fields``): request_id,
status, prompt_tokens, cached_tokens, completion_tokens, ttft_s, e2e_s, acceptance_length,
workers (``prefill -> decode`` or the aggregated worker), attempts and cause.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from proto.tandem.v1 import client_pb2 as cpb

log = logging.getLogger("services.router.requests")

FAILED = ("error", "unavailable")  # the statuses logged as failures


@dataclass(slots=True)
class RequestEnd:
    """What one request's line reports."""

    request_id: str
    status: str  # stop, length, abort, cancelled, error, unavailable
    prompt_tokens: int
    start: float  # monotonic: its admission
    first_token_at: float = 0.0  # monotonic; 0 = no token came
    usage: cpb.Usage | None = None  # the complete's, when one came
    workers: str = ""  # "prefill -> decode" or the aggregated worker; "" = none was reached
    attempts: int = 0
    cause: str = ""  # why it failed (the error message, the lost worker)

    def fields(self) -> dict:
        u = self.usage or cpb.Usage()
        now = time.monotonic()
        return {
            "request_id": self.request_id,
            "status": self.status,
            "prompt_tokens": u.prompt_tokens or self.prompt_tokens,
            "cached_tokens": u.cached_tokens,
            "completion_tokens": u.completion_tokens,
            "ttft_s": round(self.first_token_at - self.start, 4) if self.first_token_at else None,
            "e2e_s": round(now - self.start, 4),
            "acceptance_length": round(u.acceptance_length, 3),
            "workers": self.workers,
            "attempts": self.attempts,
            "cause": self.cause,
        }


def log_end(end: RequestEnd, log_requests: bool = True) -> None:
    """The request's one line: WARNING for a failure (always), INFO otherwise (unless
    ``log_requests`` is off)."""
    failed = end.status in FAILED
    if not failed and not log_requests:
        return
    f = end.fields()
    ttft = f"{f['ttft_s']:.3f} s" if f["ttft_s"] is not None else "-"
    text = (
        f"request {end.request_id} {end.status}: prompt {f['prompt_tokens']} (cached {f['cached_tokens']}), "
        f"completion {f['completion_tokens']} tokens, ttft {ttft}, e2e {f['e2e_s']:.3f} s, "
        f"AL {f['acceptance_length']:.2f}, {end.workers or 'no worker'}"
    )
    if end.attempts > 1:
        text += f", {end.attempts} attempts"
    if end.cause:
        text += f"; cause: {end.cause}"
    level = logging.WARNING if failed else logging.INFO
    log.log(level, "%s", text, extra={"fields": f, "request_id": end.request_id})


def log_refused(request_id: str, reason: str, log_requests: bool = True) -> None:
    """A request refused at admission (the client's to fix, or the router not admitting)."""
    if log_requests:
        fields = {"request_id": request_id, "status": "refused", "cause": reason}
        log.info(
            "request %s refused: %s", request_id, reason, extra={"fields": fields, "request_id": request_id}
        )
