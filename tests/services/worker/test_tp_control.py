"""Rank 0's jobs cross the control channel as JSON and arrive as the same jobs.

``RankGroup`` (rank 0's RankLinks) encodes each job, ``rank_handlers`` (ranks 1..) decodes
it and runs it on the rank's RankTransfer; here a link that round-trips every message
through ``json`` stands in for the TCP connection.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from kvcore import TransferPages
from kvcore.transfer import (
    EndpointInfo,
    HeadRoute,
    LinkTest,
    PeerRank,
    RecvJob,
    SendJob,
    TransferError,
    TransferUsage,
)
from services.worker.tp_control import RankError, rank_handlers
from services.worker.tp_group import RankGroup

PAGES = {"target": TransferPages(0, [3, 4, 9]), "draft": TransferPages(2, [7])}
ROUTES = {
    "target": HeadRoute(1, 0, slice(0, 2), slice(2, 4), False),
    "draft": HeadRoute(1, 0, slice(0, 1), slice(0, 1), True),
}


class RecordingRank:
    """Stands in for a rank's RankTransfer: keeps the jobs it is given."""

    def __init__(self) -> None:
        self.jobs: list = []

    async def send(self, job: SendJob) -> TransferUsage:
        self.jobs.append(job)
        return TransferUsage({"target": 96}, {"target": 0.5})

    async def recv(self, job: RecvJob) -> TransferUsage:
        self.jobs.append(job)
        return TransferUsage({"target": 48, "draft": 8}, {"target": 0.25, "draft": 0.125})

    async def test(self, job: LinkTest) -> None:
        self.jobs.append(job)

    async def disconnect(self, peer_id: str) -> None:
        self.jobs.append(peer_id)


class JsonLink:
    """A RankLink whose commands and answers go through ``json``, as on the wire."""

    def __init__(self, rank: RecordingRank, fail: bool = False) -> None:
        self.handlers, self.fail = rank_handlers(rank), fail

    async def call(self, op: str, **args) -> dict:
        if self.fail:
            raise RankError(f"rank 1: {op}: connection lost")
        reply = {"ok": True, **await self.handlers[op](**json.loads(json.dumps(args)))}
        return json.loads(json.dumps(reply))


def group_with(link: JsonLink) -> RankGroup:
    group = RankGroup(2, [], None, threading.Event())
    group.links = {1: link}
    return group


def test_every_job_arrives_as_it_was_sent():
    rank = RecordingRank()
    group = group_with(JsonLink(rank))
    send = SendJob(
        "r", "decode-1/rank1", 1, PAGES, ROUTES, 5.0, {"target": [0, 1, 2, 3], "draft": [-1, -1, 5]}, 7 << 24
    )
    recv = RecvJob("r", PAGES, {0: ROUTES, 1: {"target": ROUTES["target"]}}, 5.0, 9 << 24)
    peer = PeerRank("prefill-1/rank1", EndpointInfo("ucx", b"\x00\xffaddress", "127.0.0.1", 7))
    test = LinkTest(peer, "pair:a->b/1->0", True)

    async def run() -> list:
        return [
            await group.send(1, send),
            await group.recv(1, recv),
            await group.test(1, test),
            await group.disconnect(1, "prefill-1"),
        ]

    replies = asyncio.run(run())
    assert rank.jobs == [send, recv, test, "prefill-1"]
    assert replies == [
        TransferUsage({"target": 96}, {"target": 0.5}),
        TransferUsage({"target": 48, "draft": 8}, {"target": 0.25, "draft": 0.125}),
        None,
        None,
    ]


def test_a_lost_rank_is_a_transfer_error():
    group = group_with(JsonLink(RecordingRank(), fail=True))
    recv = RecvJob("r", PAGES, {0: ROUTES}, 5.0)
    with pytest.raises(TransferError, match="connection lost"):
        asyncio.run(group.recv(1, recv))
