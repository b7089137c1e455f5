"""An aggregated worker behind the router serves requests, before and after the router's
health polls (it answers Stats like any worker), and called directly."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import generate, start_cluster

pytestmark = pytest.mark.slow


def test_the_router_forwards_to_an_aggregated_worker(tiny_pair):
    cluster = start_cluster(tiny_pair, ["both"])
    try:
        tokens, complete = generate(cluster.router_address, list(range(1, 20)), 6, ignore_eos=True)
        assert len(tokens) == 6
        time.sleep(2)  # several Stats polls
        tokens, _ = generate(cluster.router_address, list(range(1, 20)), 6, ignore_eos=True)
        assert len(tokens) == 6
        worker = cluster.processes[1].grpc  # directly, with no request ids: the worker names them
        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(lambda n: generate(worker, list(range(1, n)), 6, ignore_eos=True), (20, 30)))
        assert [len(tokens) for tokens, _ in runs] == [6, 6]
    finally:
        cluster.stop()
