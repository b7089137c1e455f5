"""The engine alone under the closed loop (bench.loop_ceiling) and the prefill rate
(bench.prefill_rate) over the bundled tiny target on the CPU: every request finishes, the
phases are those the policy runs, and the counts are exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import loop_ceiling, prefill_rate
from bench.serve_workload import Lengths
from tests.services.engine.helpers import assert_pools_empty

TINY = str(Path(__file__).resolve().parents[2] / "models" / "tiny-target")


@pytest.mark.parametrize("policy", ["mixed", "decode-first"])
def test_the_closed_loop_finishes_every_request_with_the_policys_phases(policy):
    argv = ["--model", TINY, "--device", "cpu", "--kv-mb", "64", "--max-num-seqs", "8"]
    engine = loop_ceiling.make_engine(loop_ceiling.parser().parse_args(argv))
    loop_ceiling.set_variant(engine, policy, 24)
    row = loop_ceiling.closed_loop(engine, Lengths(20, 6), concurrency=3, total=7, seed=1)
    assert row["requests"] == 7
    assert row["tok_s"] > 0 and row["steps"] > 0
    ran = {name for name, ms in row["phases_ms"].items() if name != "rest" and ms > 0}
    assert ran == ({"decode", "prefill", "mixed"} if policy == "mixed" else {"decode", "prefill"})
    assert_pools_empty(engine)


def test_the_prefill_rate_counts_one_prompt_per_step():
    rows = prefill_rate.measure(TINY, "cpu", [16, 48], repeats=1, kv_mb=16)
    assert [r["tokens"] for r in rows] == [16, 48]
    assert all(r["forward_ms"] > 0 and r["gemm_tflops"] > 0 and r["of_gemm"] > 0 for r in rows)
