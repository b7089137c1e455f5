"""The wrapper of a worker's request RPCs (services/worker/request_rpc.py): the call logs
under the client's request id, is counted while it runs, is refused while the worker
drains when it would start new work, and a request the shutdown failed ends UNAVAILABLE."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from services.common.request_context import REQUEST_ID
from services.worker.request_rpc import WorkerShutdown, request_rpc


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details):
        self.status = (code, details)
        raise Aborted


class Servicer:
    def __init__(self) -> None:
        self.worker = SimpleNamespace(draining="", in_flight=0)
        self.seen: list[tuple[str, int]] = []

    @request_rpc(new_work=True)
    async def Prefill(self, request, context):
        self.seen.append((REQUEST_ID.get(), self.worker.in_flight))
        return "done"

    @request_rpc(new_work=False)
    async def Decode(self, request, context):
        raise WorkerShutdown("worker d shut down: past the shutdown timeout")


def test_a_call_is_counted_and_logs_under_the_clients_id():
    s = Servicer()
    answer = asyncio.run(s.Prefill(SimpleNamespace(request_id="cmpl-1#a1.1"), Context()))
    assert answer == "done" and s.seen == [("cmpl-1", 1)] and s.worker.in_flight == 0


def test_new_work_is_refused_while_draining_and_a_cut_request_ends_unavailable():
    s, context = Servicer(), Context()
    s.worker.draining = "worker p is shutting down: it takes no new requests"
    with pytest.raises(Aborted):
        asyncio.run(s.Prefill(SimpleNamespace(request_id="r#a1.1"), context))
    assert context.status == (grpc.StatusCode.UNAVAILABLE, s.worker.draining) and not s.seen
    with pytest.raises(Aborted):
        asyncio.run(s.Decode(SimpleNamespace(request_id="r#a1.1"), context))
    assert context.status == (grpc.StatusCode.UNAVAILABLE, "worker d shut down: past the shutdown timeout")
    assert s.worker.in_flight == 0
