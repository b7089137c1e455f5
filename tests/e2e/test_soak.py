"""A 20-second soak: 64 concurrent streams with random cancellations (``make soak`` runs
10 minutes). No errors besides the cancellations; no request holds a page at the end.
(60 s until 2026-12-04; the suite's time went to the serving-mode matrix.)"""

from __future__ import annotations

import pytest

from bench.soak import run
from tests.e2e.conftest import start_cluster

pytestmark = pytest.mark.slow


def test_twenty_seconds_of_64_streams_with_cancellations(byte_pair):
    cluster = start_cluster(byte_pair, ["prefill", "decode"])
    try:
        result = run(cluster, streams=64, seconds=20, cancel_rate=0.2, sample_s=10)
    finally:
        cluster.stop()
    tally = result["tally"]
    assert tally.errors == []
    assert tally.completed > 0 and tally.cancelled > 0
    assert all(held == 0 for held in result["held"].values()), result["held"]
