"""bench.gil_contention runs each loop mode beside the thread and reports all of them; the
paced loop leaves the GIL wanted flag cleared behind it."""

from __future__ import annotations

import json

from bench import gil_contention
from kvcore.transfer import pacing


def test_every_mode_is_measured_and_the_pacing_is_cleared(capsys):
    gil_contention.main(["--ops", "200", "--size", "8"])
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(results) == list(gil_contention.MODES)
    assert all(r["thread_ms"] > 0 for r in results.values())
    assert results["alone"]["turns_per_ms"] == 0
    assert pacing._wanted is None
