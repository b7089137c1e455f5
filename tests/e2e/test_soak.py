"""A 10-second soak: 64 concurrent streams with random cancellations (``make soak`` runs
10 minutes). No errors besides the cancellations; no request holds a page at the end.
(60 s until 2026-12-04, 20 s until 2026-12-06: the suite's 15 minutes went to the serving
modes.)"""

from __future__ import annotations

import pytest

from bench.soak import run
from tests.e2e.conftest import start_cluster

pytestmark = pytest.mark.slow


def test_ten_seconds_of_64_streams_with_cancellations(byte_pair):
    cluster = start_cluster(byte_pair, ["prefill", "decode"])
    try:
        result = run(cluster, streams=64, seconds=10, cancel_rate=0.2, sample_s=5)
    finally:
        cluster.stop()
    tally = result["tally"]
    assert tally.errors == []
    assert tally.completed > 0 and tally.cancelled > 0
    assert all(held == 0 for held in result["held"].values()), result["held"]
