"""Shared pieces of the router's tests: workers that cannot be reached, a worker's stream
call (a Prefill's among them), waiting for state."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import grpc

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import worker_pb2 as wpb
from services.common.metrics import Metrics
from services.router.api import ModelLimits, RouterAPI, RouterSettings
from services.router.registry import PairState

PAGE = 4


class StreamCall:
    """A worker's server-stream call: sends ``messages`` (an exception among them is
    raised), then ends (``end``) or sends nothing more."""

    def __init__(self, messages: list, end: bool = False, delay_s: float = 0.0) -> None:
        """``delay_s``: before the first message, as a call whose worker is busy."""
        self.messages, self.end, self.cancelled, self.delay_s = list(messages), end, False, delay_s

    def __aiter__(self):
        return self._messages()

    async def _messages(self):
        while (message := await self.read()) is not grpc.aio.EOF:
            yield message

    async def read(self):
        await asyncio.sleep(self.delay_s)
        self.delay_s = 0.0
        if self.messages:
            item = self.messages.pop(0)
            if isinstance(item, BaseException):
                raise item
            return item
        if self.end:
            return grpc.aio.EOF
        await asyncio.sleep(60)

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def done(self) -> bool:
        return self.cancelled


def prefill_answer(
    first_token_id: int = 7, finish_reason: int = cpb.FINISH_REASON_UNSPECIFIED, end: bool = True
) -> StreamCall:
    """A Prefill stream whose pages landed: the first token, then the usage (``end``: then
    the call ends; else it sends nothing more)."""
    first = wpb.PrefillResponse(first_token_id=first_token_id, finish_reason=finish_reason)
    return StreamCall([first, wpb.PrefillResponse(usage=cpb.Usage(prompt_tokens=1))], end=end)


def dead_address() -> str:
    """host:port where nothing listens: connections are refused (UNAVAILABLE)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def rank_info(instance_id: str, role: int, address: str = "") -> rpb.RankInfo:
    """A RankInfo the helpers' router's contract accepts (schema 1, PAGE tokens per page)."""
    return rpb.RankInfo(
        schema_version=1,
        instance_id=instance_id,
        role=role,
        grpc_address=address or dead_address(),
        tokens_per_page=PAGE,
    )


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Return once ``condition()`` holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def router(options: RouterSettings | None = None, **limits) -> RouterAPI:
    """A router in this process; without ``options`` its requests do not wait for workers at
    start (``startup_wait_s`` 0): these tests register theirs, or none on purpose."""
    model = dict(model_id="tiny", vocab_size=264, max_model_len=64) | limits
    options = options or RouterSettings(tokens_per_page=PAGE, startup_wait_s=0.0)
    return RouterAPI(ModelLimits(**model), Metrics("router"), options)


async def unreachable_ready_pairs(api: RouterAPI, prefills: list[str], decodes: list[str]) -> None:
    """Register workers nobody can reach and mark their pairs READY, as if they had been."""
    for ids, role in ((decodes, rpb.ROLE_DECODE), (prefills, rpb.ROLE_PREFILL)):
        for worker_id in ids:
            await api.registration.register(reg.RegisterRequest(rank_info=rank_info(worker_id, role)))
    registry = api.cluster.registry
    await until(lambda: all(p.state != PairState.PENDING for p in registry.pairs.values()))
    for prefill_id, decode_id in list(registry.pairs):
        registry.set_pair(prefill_id, decode_id, PairState.READY)
