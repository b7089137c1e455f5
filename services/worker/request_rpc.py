"""The worker RPCs that serve a request: what each does first and last.

``request_rpc(new_work)`` wraps a servicer method (its servicer has ``worker``, a
WorkerBase, and the request a ``request_id``):
- the rest of the call logs as about the request (services/common/request_context.py:
  the client's id inside the attempt id);
- ``worker.in_flight`` counts the call while it runs (a shutdown waits for it to be 0);
- while the worker drains (``worker.draining``), a call that would start new work
  (``new_work``: Reserve, Prefill, an aggregated Generate) is refused with UNAVAILABLE
  naming the reason, before it does anything; one that finishes work already begun (a
  Decode of a reservation made before) runs;
- a request the shutdown failed (WorkerShutdown raised from the engine loop) ends the
  call with UNAVAILABLE and that message: the router retries it elsewhere before its first
  token, and tells the client after.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import grpc

from services.common.request_context import bind_request


class WorkerShutdown(RuntimeError):
    """A request the worker's shutdown ended (services/worker/shutdown.py)."""


def request_rpc(new_work: bool) -> Callable:
    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        async def handler(self, request, context):
            bind_request(request.request_id)
            worker = self.worker
            if new_work and worker.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, worker.draining)
            worker.in_flight += 1
            try:
                return await method(self, request, context)
            except WorkerShutdown as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            finally:
                worker.in_flight -= 1

        return handler

    return wrap
