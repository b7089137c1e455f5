"""The engine's own decode ceiling (bench.serve_ceiling) over a tiny random pair on the CPU:
a forced AL is exact, and the batch is capped by max_num_seqs."""

from __future__ import annotations

import math

import pytest

from bench.random_model import build
from bench.random_shapes import PRESETS
from bench.serve_ceiling import fastest, main, make_engine, measure
from bench.serve_ceiling_spec import CeilingSpec
from bench.serve_workload import Lengths


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build(tmp_path_factory.mktemp("random"), PRESETS["tiny"], shards=5, device="cpu")


def test_the_ceiling_at_a_forced_al_keeps_exactly_n_drafts_and_caps_the_batch(pair):
    spec = CeilingSpec(str(pair[0]), str(pair[1]), k=3, forced=2, device="cpu", max_num_seqs=4, kv_mb=64)
    rows = measure(spec, [Lengths(16, 10)], [2, 8])  # 9 decode tokens: 3 steps of AL 3
    assert [(r["batch"], r["ceiling_batch"], r["al"]) for r in rows] == [(2, 2, 3.0), (8, 4, 3.0)]
    assert all(r["tok_s"] > 0 and r["ms_per_step"] > 0 for r in rows)


def test_the_fastest_run_is_kept_and_nan_only_when_every_run_is():
    runs = [{"tok_s": math.nan}, {"tok_s": 5.0}, {"tok_s": 3.0}]
    assert fastest(runs) == {"tok_s": 5.0}
    assert math.isnan(fastest([{"tok_s": math.nan}])["tok_s"])


def test_kv_sized_from_the_gpu_is_refused_on_a_cpu(pair, capsys):
    with pytest.raises(SystemExit):
        main(["--model", str(pair[0]), "--device", "cpu", "--grid", "16/4", "--batches", "1"])
    assert "--kv-mb: 0 sizes the KV cache from a GPU's memory; on cpu give MiB" in capsys.readouterr().err


def test_kv_mb_0_asks_for_the_gpu_fraction_and_mib_for_a_fixed_cache(pair):
    spec = CeilingSpec(str(pair[0]), "", k=0, forced=0, device="cpu", max_num_seqs=4, kv_mb=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization: sizes the KV cache from a CUDA device"):
        make_engine(spec)  # a CPU engine refuses the fraction: the CUDA path asks for it
    engine = make_engine(CeilingSpec(str(pair[0]), "", 0, 0, "cpu", 4, kv_mb=8))
    assert engine.config.kv_cache_bytes == 8 << 20 and engine.config.gpu_memory_utilization == 0.0
