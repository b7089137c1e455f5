"""The K a client sees and may ask for is the one the workers serve: a router started with
``-k 4`` in front of workers without a drafter advertises 0 and refuses speculation."""

from __future__ import annotations

import asyncio

import pytest

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from services.router.errors import ErrorCode, RouterError
from tests.services.router.helpers import rank_info, router


def _asking(k: int) -> cpb.GenerateRequest:
    prompt = cpb.TokenIds(ids=[1, 2, 3])
    request = cpb.GenerateRequest(token_ids=prompt, sampling=cpb.SamplingParams(max_tokens=4))
    request.speculative.num_spec_tokens = k
    return request


def test_the_advertised_k_is_the_workers_and_a_request_over_it_is_refused():
    async def scenario():
        api = router(num_spec_tokens=4)
        before = (await api.model_info()).num_spec_tokens
        worker = rank_info("decode-0", rpb.ROLE_DECODE)  # num_spec_tokens 0: no drafter
        await api.registration.register(reg.RegisterRequest(rank_info=worker))
        after = (await api.model_info()).num_spec_tokens
        with pytest.raises(RouterError) as refused:
            api._admit(_asking(2), owner="")
        plain = api._admit(_asking(0), owner="")
        await api.close()
        return before, after, refused.value, plain.rid

    before, after, refused, rid = asyncio.run(scenario())
    assert (before, after) == (4, 0)
    assert refused.code == ErrorCode.INVALID_ARGUMENT
    assert str(refused).startswith("speculative.num_spec_tokens: 2 exceeds the server's K = 0")
    assert rid
