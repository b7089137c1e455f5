"""The limits a router serves under: its own, lowered by what its workers publish.

Every worker's RankInfo says how long one request may be there (``max_model_len``: its
``--max-model-len`` or the model's positions) and what its empty KV cache holds
(``max_request_tokens``: every layer group and the speculative headroom counted), and
how many drafts it verifies (``num_spec_tokens``, 0 without a drafter).

Invariants:
- The served context is the least of the router's own ``max_model_len`` and every
  counted worker's ``max_model_len`` and ``max_request_tokens``: a request within it fits
  any worker it may be sent to, so the router never queues one that can never run.
- Counted workers are the registered ones the health check has not lost; a field of 0
  (not published) bounds nothing. Before any worker counts, the router's own limits hold.
- K is the least of the router's ``-k`` and every registered worker's (lost ones too: a
  request may not ask more drafts than a worker that comes back verifies).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from services.router.registry import Worker


@dataclass(slots=True)
class ModelLimits:
    """What the router serves: the model's name and vocabulary, the longest request, K."""

    model_id: str = ""  # the served model name (--served-model-name; default the folder's)
    vocab_size: int = 264
    max_model_len: int = 2048  # tokens, prompt plus completion
    max_request_tokens: int = 0  # what the smallest worker's empty KV cache holds; 0 = unknown
    default_max_tokens: int = 0  # what max_tokens = 0 means; 0 = the room the prompt leaves (as vLLM)
    num_spec_tokens: int = 0


def served_limits(limits: ModelLimits, workers: Iterable[Worker]) -> ModelLimits:
    """``limits`` with ``num_spec_tokens``, ``max_model_len`` and ``max_request_tokens``
    lowered to what ``workers`` serve (see the module's invariants)."""
    workers = list(workers)
    healthy = [w.info for w in workers if w.healthy]
    context = _least(limits.max_model_len, [i.max_model_len for i in healthy])
    kv = _least(limits.max_request_tokens, [i.max_request_tokens for i in healthy])
    k = min([limits.num_spec_tokens, *(w.info.num_spec_tokens for w in workers)])
    return replace(limits, num_spec_tokens=k, max_model_len=context, max_request_tokens=kv)


def _least(own: int, published: list[int]) -> int:
    """The least of ``own`` and the published values; 0 (unset) bounds nothing."""
    values = [v for v in (own, *published) if v > 0]
    return min(values, default=0)


def longest_request(limits: ModelLimits) -> int:
    """The longest request (prompt plus completion) ``limits`` admit: the context, or the
    KV cache's bound where that is less."""
    if limits.max_request_tokens:
        return min(limits.max_model_len, limits.max_request_tokens)
    return limits.max_model_len
