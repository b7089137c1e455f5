"""The longest request a client sees and may send is the one the workers serve: ModelInfo
advertises the least of the router's context and every healthy worker's max_model_len and
KV bound, and a request over it is refused at once, naming the numbers."""

from __future__ import annotations

import asyncio

import pytest

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from services.router.api import ModelLimits
from services.router.capacity import longest_request, served_limits
from services.router.errors import ErrorCode, RouterError
from services.router.registry import Worker
from tests.services.router.helpers import rank_info, router


def _worker(max_model_len: int, kv: int, k: int = 0, healthy: bool = True) -> Worker:
    info = rpb.RankInfo(max_model_len=max_model_len, max_request_tokens=kv, num_spec_tokens=k)
    return Worker(info, healthy=healthy)


def test_the_least_published_bound_holds_and_unset_or_lost_ones_bound_nothing():
    own = ModelLimits(max_model_len=131072, num_spec_tokens=4)
    assert served_limits(own, []) == own
    workers = [_worker(4096, 3000, k=4), _worker(0, 0, k=4), _worker(100, 50, healthy=False)]
    served = served_limits(own, workers)
    assert (served.max_model_len, served.max_request_tokens) == (4096, 3000)
    assert longest_request(served) == 3000
    assert served_limits(own, [_worker(100, 50, k=0, healthy=False)]).num_spec_tokens == 0


def _request(prompt_len: int, max_tokens: int) -> cpb.GenerateRequest:
    prompt = cpb.TokenIds(ids=[1] * prompt_len)
    return cpb.GenerateRequest(token_ids=prompt, sampling=cpb.SamplingParams(max_tokens=max_tokens))


def test_model_info_advertises_the_workers_bound_and_a_request_over_it_is_refused_at_once():
    async def scenario():
        api = router(max_model_len=131072)
        before = (await api.model_info()).max_model_len
        worker = rank_info("decode-0", rpb.ROLE_DECODE)
        worker.max_model_len, worker.max_request_tokens = 2048, 1000
        await api.registration.register(reg.RegisterRequest(rank_info=worker))
        after = (await api.model_info()).max_model_len
        with pytest.raises(RouterError) as refused:
            api._admit(_request(10, 991), owner="")
        fits = api._admit(_request(10, 990), owner="")
        await api.close()
        return before, after, refused.value, fits.rid

    before, after, refused, rid = asyncio.run(scenario())
    assert (before, after) == (131072, 1000)
    assert refused.code == ErrorCode.INVALID_ARGUMENT
    assert str(refused) == (
        "sampling.max_tokens: 10 prompt tokens + 991 = 1001 exceed the 1000 tokens the workers' "
        "KV cache holds for one request"
    )
    assert rid
