"""How a failed page transfer is named across services, so the router can tell it apart.

A prefill worker whose transfer to a decode worker failed answers ``UNAVAILABLE`` (the
request may be retried on another pair) with details from :func:`describe`; a decode
worker whose pages did not land answers ``UNAVAILABLE`` with :func:`describe_landing`.
The router reads both with :func:`is_transfer_failure` and marks the pair degraded.
"""

from __future__ import annotations

TRANSFER_FAILED = "transfer failed"
PAGES_NOT_LANDED = "pages did not land"


def describe(decode_id: str, error: BaseException) -> str:
    """The prefill side's status details for a transfer to ``decode_id`` that failed."""
    return f"{TRANSFER_FAILED} to {decode_id}: {error}"


def describe_landing(error: BaseException) -> str:
    """The decode side's status details for pages that did not land."""
    return f"{PAGES_NOT_LANDED}: {error!r}"


def is_transfer_failure(details: str) -> bool:
    """Whether status ``details`` name a failed transfer (either side's)."""
    return details.startswith((TRANSFER_FAILED, PAGES_NOT_LANDED))
