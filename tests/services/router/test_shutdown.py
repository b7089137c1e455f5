"""The router's graceful shutdown in process (services/router/shutdown.py): it stops
admitting at once (health NOT_SERVING, new requests UNAVAILABLE / HTTP 503 saying why),
waits for the requests in flight, and cuts the rest short with an error naming the
timeout, logged once as a failure with that cause."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from proto.tandem.v1 import client_pb2 as cpb
from services.common.grpc_server import NOT_SERVING, READY_SERVICE
from services.router.api import RouterSettings
from services.router.errors import ErrorCode, RouterError
from services.router.openai_api import OpenAIServer
from services.router.shutdown import REFUSAL, shut_down
from tests.services.router.helpers import PAGE, router
from tests.services.router.scripted_router import call


class RecordedHealth:
    """Stands in for ServiceHealth: the statuses set, in order."""

    def __init__(self) -> None:
        self.sets: list[tuple[str, int]] = []

    async def set(self, name: str, status) -> None:
        self.sets.append((name, status))


def _request(rid: str) -> cpb.GenerateRequest:
    return cpb.GenerateRequest(
        request_id=rid, token_ids=cpb.TokenIds(ids=[1, 2, 3]), sampling=cpb.SamplingParams(max_tokens=4)
    )


def test_a_router_shutting_down_refuses_new_requests_and_says_so_in_its_health():
    api = router()
    health = RecordedHealth()
    assert asyncio.run(shut_down(api, health, 1.0)) == 0
    assert set(health.sets) == {(READY_SERVICE, NOT_SERVING), ("", NOT_SERVING)}
    assert api.health_monitor.readiness is None  # its polls may not report it ready again
    answer = asyncio.run(api.health())
    assert answer.status == cpb.SERVING_STATUS_NOT_SERVING and answer.message == REFUSAL

    async def refused():
        async for _ in api.generate(_request("late")):
            pass

    with pytest.raises(RouterError) as e:
        asyncio.run(refused())
    assert e.value.code == ErrorCode.UNAVAILABLE and "router is shutting down" in e.value.message
    server = OpenAIServer(api)
    assert call(server, "/health").status == 503
    response = call(server, "/v1/completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
    assert response.status == 503
    assert "router is shutting down" in json.loads(response.body)["error"]["message"]


def test_a_request_still_running_at_the_timeout_ends_with_an_error_naming_it(caplog):
    # no worker yet: the request waits for one (startup_wait_s) until the shutdown cuts it
    api = router(RouterSettings(tokens_per_page=PAGE, startup_wait_s=30.0))

    async def scenario():
        messages: list[cpb.GenerateResponse] = []

        async def client():
            async for message in api.generate(_request("slow")):
                messages.append(message)

        task = asyncio.ensure_future(client())
        while not api.flows:
            await asyncio.sleep(0.01)
        cut = await shut_down(api, RecordedHealth(), 0.2)
        await task
        return cut, messages

    with caplog.at_level(logging.INFO):
        cut, messages = asyncio.run(scenario())
    assert cut == 1 and not api.flows
    error, complete = messages
    assert "router shut down" in error.error.message and "shutdown timeout (0.2 s" in error.error.message
    assert complete.complete.finish_reason == cpb.FINISH_REASON_ERROR
    lines = [r for r in caplog.records if r.name == "services.router.requests"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert lines[0].fields["status"] == "error" and "shutdown timeout" in lines[0].fields["cause"]
    assert lines[0].request_id == "slow"
