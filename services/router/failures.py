"""How a worker's failure ends a step of a request, before the request emitted anything.

- ``Busy``: the decode worker has no free pages now (RESOURCE_EXHAUSTED): queue and retry.
- ``Retry``: the worker was unavailable or timed out (or was found dead): try another pair.
- ``Abort``: the client aborted the request.
- ``Fail``: any other status; no other worker would do better, so the request fails.

After tokens streamed, a dead decode worker is ``RouterError(UNAVAILABLE)`` instead
(errors.py): the client must see the request fail, not restart.
"""

from __future__ import annotations

import grpc

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class Busy(Exception):
    """The decode worker has no free pages for the request now."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id


class Retry(Exception):
    """A worker failed before the request emitted anything: try another pair."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id


class Abort(Exception):
    """The client aborted the request before its first token."""


class Fail(Exception):
    """A worker refused the request for a reason no other worker would fix."""

    def __init__(self, message: str) -> None:
        self.message = message


def classify(error: grpc.aio.AioRpcError, worker_id: str) -> Busy | Retry | Fail:
    """The step's outcome from the status ``worker_id`` answered."""
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Busy(worker_id)
    if error.code() in RETRYABLE:
        return Retry(worker_id)
    return Fail(f"worker {worker_id}: {error.code().name}: {error.details()}")
