"""What a TP rank does on rank 0's word, without the wire: JSON forms and pool effects."""

from __future__ import annotations

import asyncio

import torch

from kvcore.manager import TransferPages
from kvcore.transfer.head_routes import HeadRoute
from kvcore.transfer.kv_transfer import KVTransferAgent, TransferUsage
from services.common.tp_ops import (
    RankOps,
    merge_usage,
    pages_from_json,
    pages_to_json,
    routes_from_json,
    routes_to_json,
)
from tests.kvcore.conftest import make_manager


def test_pages_and_routes_survive_json():
    pages = {"target": TransferPages(0, [3, 4, 9]), "draft": TransferPages(2, [7])}
    routes = {"target": HeadRoute(1, 0, slice(0, 2), slice(2, 4), False)}
    assert pages_from_json(pages_to_json(pages)) == pages
    assert routes_from_json(routes_to_json(routes)) == routes


def test_usage_adds_bytes_and_keeps_the_slowest_seconds():
    total = merge_usage(TransferUsage(), {"bytes": {"target": 10}, "seconds": {"target": 0.5}})
    merge_usage(total, TransferUsage({"target": 5, "draft": 1}, {"target": 0.2, "draft": 0.1}))
    assert total.bytes == {"target": 15, "draft": 1}
    assert total.seconds == {"target": 0.5, "draft": 0.1}


def test_pages_that_do_not_travel_are_zeroed_on_the_other_ranks():
    """The separate layout: the draft window is not sent, so every rank's drafter starts
    from zeros, as rank 0's does."""
    manager = make_manager()
    manager.pools["draft"].fill_(1.0)
    ops = RankOps(KVTransferAgent(manager, hidden_size=8))
    reply = asyncio.run(ops.recv("r", pages={}, sources=[], timeout_s=1.0, zero={"draft": [2, 5]}))
    assert reply == {"bytes": {}, "seconds": {}}
    draft = manager.pools["draft"]
    assert torch.all(draft[[2, 5]] == 0) and torch.all(draft[[0, 1, 3, 4]] == 1)
