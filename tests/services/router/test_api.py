"""RouterAPI.model_info and /v1/models over it: a worker that forces acceptance (benchmarks
only) is reported, so no result served through it is taken for the target's own."""

from __future__ import annotations

import asyncio
import json

from proto.tandem.v1 import rank_info_pb2 as rpb
from services.router.openai_api import OpenAIServer
from tests.services.router.helpers import rank_info, router
from tests.services.router.scripted_router import call


def _worker(instance_id: str, forced: int | None = None) -> rpb.RankInfo:
    info = rank_info(instance_id, rpb.ROLE_BOTH)
    if forced is not None:
        info.unsafe_forced_acceptance = forced
    return info


def test_model_info_reports_a_worker_that_forces_acceptance():
    api = router(max_model_len=4096)
    info = asyncio.run(api.model_info())
    assert not info.HasField("unsafe_forced_acceptance") and info.max_model_len == 4096
    api.cluster.registry.add(_worker("both-0"))
    assert not asyncio.run(api.model_info()).HasField("unsafe_forced_acceptance")
    api.cluster.registry.add(_worker("both-1", forced=0))  # AL 1: every draft "rejected"
    info = asyncio.run(api.model_info())
    assert info.HasField("unsafe_forced_acceptance") and info.unsafe_forced_acceptance == 0


def test_v1_models_says_forced_acceptance_and_the_effective_context():
    api = router(max_model_len=4096)
    models = json.loads(call(OpenAIServer(api), "/v1/models").body)["data"][0]
    assert (models["max_model_len"], models["tandem"]["unsafe_forced_acceptance"]) == (4096, None)
    api.cluster.registry.add(_worker("both-0", forced=3))
    models = json.loads(call(OpenAIServer(api), "/v1/models").body)["data"][0]
    assert models["tandem"]["unsafe_forced_acceptance"] == 3
