"""How a failed Reserve, Prefill or Decode step (or an aggregated worker's stream) ends a
request's attempt (or the request), and whether a request with no READY pair may wait for
a degraded one.

- A Reserve cancelled because the health check lost its decode worker, or past its
  deadline, is a Retry on another pair; what it may have reserved is released.

- A prefill that answers UNAVAILABLE naming a failed transfer (services/common/
  transfer_failure.py) marks its pair DEGRADED and is a Retry that excludes no worker:
  the pair is out of service until it is re-paired, its workers may serve other pairs.
- A Decode whose pages did not land degrades its pair too; after the first token it still
  ends the request UNAVAILABLE, as does a Decode stream past its idle deadline.
- A request with no READY pair waits, as a queued one, for a DEGRADED or FAILED pair of
  workers it has not excluded, for at most HEAL_WAIT_S from its start or from that pair's
  failure, whichever is later (a request whose own transfer timed out may wait for the
  pair it broke on).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import grpc

from proto.tandem.v1 import client_pb2 as cpb
from services.common.transfer_failure import is_transfer_failure
from services.router import messages as msg
from services.router.cluster import Cluster
from services.router.errors import ErrorCode, RouterError
from services.router.failures import RETRYABLE, Abort, Fail, Retry, classify
from services.router.messages import Usage
from services.router.streams import StreamStalled


class RequestFlow(Protocol):
    """What the failure handlers read of a request's state (dispatch.RequestFlow)."""

    rid: str
    attempt: str  # the id the workers know the current attempt by
    token_ids: list[int]  # the prompt's
    aborted: bool
    lost: str  # the worker the health check lost mid-call, or ""
    reserved_on: str  # the decode worker holding a reservation no Decode owns, or ""
    prefilled_by: str
    cluster: Cluster
    usage: Usage


HEAL_WAIT_S = 10.0  # how long a request waits for a degraded pair when no pair is READY
STARTUP_WAIT_S = 10.0  # how long a new router's requests wait for its first workers


def may_heal(cluster: Cluster, start: float, excluded: set[str]) -> bool:
    """Whether a DEGRADED or FAILED pair of workers not in ``excluded`` may come back for a
    request that started at ``start`` (monotonic seconds): within HEAL_WAIT_S of the later
    of its start and the pair's failure. A router that started less than its
    ``startup_wait_s`` ago with no worker yet waits too: a restarted router's workers
    register again within seconds."""
    registry, now, wait = cluster.registry, time.monotonic(), cluster.startup_wait_s
    if not registry.workers and now - cluster.started < wait and now - start < wait:
        return True
    return any(
        p not in excluded
        and d not in excluded
        and now - max(start, registry.pairs[(p, d)].since) <= HEAL_WAIT_S
        for p, d in registry.retried_pairs()
    )


def prefill_failure(
    flow: RequestFlow, error: BaseException, prefill_id: str, decode_id: str
) -> BaseException:
    """The outcome of ``flow``'s failed Prefill on ``prefill_id`` into ``decode_id``."""
    if flow.aborted:
        return Abort()
    if flow.lost:
        return Retry(flow.lost)
    if isinstance(error, asyncio.CancelledError):
        return error
    if error.code() in RETRYABLE and is_transfer_failure(error.details() or ""):
        flow.cluster.registry.degrade(prefill_id, decode_id, f"{prefill_id}: {error.details()}")
        return Retry(f"{prefill_id}->{decode_id}")  # counts as an attempt; the pair is out
    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # slow here would be slow elsewhere
        n = len(flow.token_ids)
        deadline = flow.cluster.deadlines.describe_prefill(n)
        return Fail(f"prefill of {n} tokens on {prefill_id} did not finish within its deadline, {deadline}")
    return classify(error, prefill_id)


def reserve_failure(flow: RequestFlow, error: BaseException, decode_id: str) -> BaseException:
    """The outcome of ``flow``'s failed or cancelled Reserve on ``decode_id``. A Reserve
    that may have taken pages (cancelled, or past its deadline) is released in the
    background, else the worker's lease frees them; one the client aborted stays
    ``reserved_on``, for the flow's end to release."""
    if flow.aborted:
        return Abort()
    timed_out = isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(error, asyncio.CancelledError) and not flow.lost:
        return error  # the router's own task was cancelled: the flow's end releases
    flow.reserved_on = ""
    if flow.lost or timed_out:
        flow.cluster.spawn(flow.cluster.release(decode_id, flow.attempt))
        return Retry(decode_id)
    return classify(error, decode_id)


def forward_failure(flow: RequestFlow, error: BaseException, worker_id: str) -> list[cpb.GenerateResponse]:
    """The messages ending an aggregated worker's broken stream; raises as decode_failure
    does when its worker was lost or the router's own task was cancelled."""
    if flow.aborted:
        return msg.aborted(flow.rid)
    if isinstance(error, StreamStalled):
        raise RouterError(ErrorCode.UNAVAILABLE, f"worker {worker_id} sent {error}")
    if flow.lost:
        raise RouterError(ErrorCode.UNAVAILABLE, f"worker {worker_id} is unavailable")
    if isinstance(error, asyncio.CancelledError):
        raise error
    return msg.failed(flow.rid, f"worker {worker_id}: {error.code().name}: {error.details()}")


def decode_failure(flow: RequestFlow, error: BaseException, decode_id: str) -> list[cpb.GenerateResponse]:
    """The messages ending a Decode stream that broke; raises when the request cannot
    end by a message (its decode worker died, or the router's own task was cancelled)."""
    if flow.aborted:
        return msg.aborted(flow.rid, flow.usage.merged())
    if isinstance(error, StreamStalled):
        raise RouterError(ErrorCode.UNAVAILABLE, f"decode worker {decode_id} sent {error}")
    gone = isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
    if gone and is_transfer_failure(error.details() or ""):
        flow.cluster.registry.degrade(flow.prefilled_by, decode_id, f"{decode_id}: {error.details()}")
    if flow.lost or gone:  # the worker's own reason (e.g. its shutdown), when it gave one
        why = f": {error.details()}" if gone and not flow.lost and error.details() else ""
        raise RouterError(ErrorCode.UNAVAILABLE, f"decode worker {decode_id} is unavailable{why}")
    if isinstance(error, asyncio.CancelledError):
        raise error
    message = f"decode worker {decode_id}: {error.code().name}: {error.details()}"
    return msg.failed(flow.rid, message, flow.usage.merged())


def ending_of(rid: str, outcome: Abort | Fail, usage: cpb.Usage | None = None) -> list[cpb.GenerateResponse]:
    """The messages ending a request that was aborted or failed before Decode (``usage``:
    its first token's, once the client has it)."""
    if isinstance(outcome, Abort):
        return msg.aborted(rid, usage)
    return msg.failed(rid, outcome.message, usage)
