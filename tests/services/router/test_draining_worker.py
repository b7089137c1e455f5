"""A worker that drains (Deregister with draining): the router sends it no new request but
keeps it, and its channel, for the requests in flight there; deregistered again, it is gone."""

from __future__ import annotations

import asyncio

from proto.tandem.v1 import rank_info_pb2 as rpb
from tests.services.router.helpers import router, unreachable_ready_pairs


def test_a_draining_worker_gets_no_new_request_and_keeps_its_channel_until_it_leaves():
    api = router()

    async def scenario():
        await unreachable_ready_pairs(api, ["p0"], ["d0", "d1"])
        registry = api.cluster.registry
        before = sorted(registry.ready_pairs())
        drained = await api.registration.deregister("d0", draining=True)
        during = (
            sorted(registry.ready_pairs()),
            registry.live_ids(rpb.ROLE_DECODE),
            "d0" in registry.workers,
            "d0" in api.cluster.channels,
            registry.choose_pair([1, 2, 3])[1].id,
        )
        gone = await api.registration.deregister("d0")
        after = ("d0" in registry.workers, "d0" in api.cluster.channels)
        await api.close()
        return before, drained, during, gone, after

    before, drained, during, gone, after = asyncio.run(scenario())
    assert before == [("p0", "d0"), ("p0", "d1")] and drained
    assert during == ([("p0", "d1")], ["d1"], True, True, "d1")
    assert gone and after == (False, False)
