"""The served-load sweep: its flags' refusals and the worker arguments it builds, and one tiny
point end to end on the CPU with the bundled pair (aggregated and 1P+1D, C = 2, two requests
of 32 prompt / 8 output tokens): the JSON, the table, the SVG, exact token and byte counts."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest

from bench import serve_sweep
from bench.serve_args import Config, configs, flag_of, parse, text_flag_of, worker_roles
from bench.serve_ceiling_spec import CeilingSpec
from services.engine.models.config import read_config_json

TINY_POINT = ["--device", "cpu", "--spec", "on", "--grid", "32/8", "--concurrency", "2", "--rounds", "1",
              "--min-requests", "2", "--warmup", "0"]  # fmt: skip


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--spec", "off", "-k", "3"], "-k: not read"),
        (["--layouts", "agg", "--decode-args", "--kv-cache-mb 9"], "--decode-args: not read"),
        (["--ceiling", "off", "--ceiling-kv-mb", "9"], "--ceiling-kv-mb: not read"),
        (["--rates", "", "--poisson-seconds", "3"], "--poisson-seconds: not read"),
        (["--poisson-seconds", "3"], "--poisson-seconds: not read"),  # cpu: no rates by default
        (["--worker-args", "--device cuda"], "--device: set by the sweep"),
        (["-k", "2", "--forced-accept", "3"], "--forced-accept 3 keeps more drafts than -k 2"),
        (["--layouts", "agg,2p2d"], "unknown ['2p2d']"),
        (["--grid", "512"], "--grid: '512' is not ISL/OSL"),
    ],
)
def test_refused_flags_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err


def test_cuda_needs_a_model_and_defaults_to_the_stated_sweep(capsys):
    with pytest.raises(SystemExit):
        parse([])
    assert "python -m bench.random_model" in capsys.readouterr().err
    a = parse(["--model", "m", "--drafter", "d"])
    assert [g.name for g in a.grid] == ["512/128", "2048/256", "8192/256"]
    assert (a.concurrency, a.rates, a.forced_accept, a.k) == ([1, 8, 32, 64, 128], [1.0, 2.0, 4.0, 8.0], 3, 4)
    assert (a.slo_ttft_ms, a.slo_tpot_ms, a.client_procs) == (500.0, 25.0, 4)


def test_worker_arguments_of_each_configuration():
    a = parse(
        ["--model", "m", "--drafter", "d", "--worker-args", "--max-num-seqs 32", "--decode-args", "--dtype x"]
    )
    assert [c.name for c in configs(a)] == ["agg-spec", "1p1d-spec", "agg-nospec", "1p1d-nospec"]
    spec, roles = worker_roles(Config("1p1d", True, 4, 3), a)
    assert spec == ["--model", "m", "--device", "cuda", "--drafter", "d", "-k", "4",
                    "--unsafe-forced-acceptance", "3", "--max-num-seqs", "32"]  # fmt: skip
    assert roles == [("prefill", ["--gpu-memory-utilization", "0.3"]), ("decode", ["--dtype", "x"])]
    plain, roles = worker_roles(Config("agg", False, 4, 3), a)
    assert plain[4:8] == ["--drafter", "none", "-k", "0"] and roles == [
        ("both", ["--gpu-memory-utilization", "0.9"])
    ]
    assert Config("agg", True, 4, 3).label == "aggregated, forced AL 4 (K 4)"
    assert Config("1p1d", False, 4, 3).label == "1P+1D, no drafter"
    assert (flag_of(spec, "--max-num-seqs", 64), flag_of(["--max-num-seqs=8"], "--max-num-seqs", 64)) == (
        32,
        8,
    )


def test_the_workers_quantization_reaches_the_ceiling_engine():
    argv = ["--model", "m", "--quantization", "fp8", "--quantization=none", "--quantization", "fp8"]
    assert (text_flag_of(argv, "--quantization", ""), text_flag_of([], "--quantization", "")) == ("fp8", "")
    spec = CeilingSpec("m", "", 0, 0, "cuda", 64, 1024, quantization="fp8")
    assert spec.argv()[-2:] == ["--quantization", "fp8"]
    assert CeilingSpec("m", "", 0, 0, "cuda", 64, 1024).argv()[-2:] == ["--quantization", "none"]


def test_a_flag_the_worker_lacks_is_refused_before_anything_starts():
    with pytest.raises(SystemExit, match="tandem worker does not take --no-such-flag"):
        serve_sweep.check_flags([["--kv-cache-mb", "9"], ["--no-such-flag", "1"]])


def page_bytes(folder: str, layers: int) -> int:
    """Bytes of 16 tokens of K and V over ``layers`` layers of the folder's float32 model."""
    c = read_config_json(folder)
    return 16 * layers * 2 * c["num_key_value_heads"] * c["head_dim"] * 4


@pytest.mark.slow
def test_one_tiny_point_end_to_end(tmp_path):
    payload = serve_sweep.main([*TINY_POINT, "--out", str(tmp_path)])
    assert payload["failures"] == [] and payload["ceiling_errors"] == {}
    assert json.loads((tmp_path / "sweep.json").read_text())["points"] == json.loads(
        json.dumps(payload["points"])
    )
    agg, disagg = payload["points"]
    for p, config in ((agg, "agg-spec"), (disagg, "1p1d-spec")):
        assert (p["config"], p["mode"], p["concurrency"], p["isl"], p["osl"]) == (config, "closed", 2, 32, 8)
        assert (p["requests"], p["errors"], p["output_tokens"]) == (
            2,
            0,
            16,
        )  # every request exactly 8 tokens
        assert (
            p["goodput_req_s"] <= p["requests_per_s"] and p["ceiling_batch"] == 2 and p["ceiling_tok_s"] > 0
        )
        assert (
            1.0 <= p["ceiling_al"] <= 5.0
            and 1.0 <= p["acceptance_length"] <= 5.0
            and 0 < p["ttft_ms"]["p50"] <= p["ttft_ms"]["p99"]
        )
        assert p["served_over_ceiling"] == pytest.approx(p["output_tok_s"] / p["ceiling_tok_s"])
    assert agg["transfers"] == {}
    # the engine steps over each point, per worker: the aggregated one prefilled and
    # decoded (a prompt that came mid-decode in a step of both); of the pair, the prefill
    # worker only prefilled, the decode worker only decoded
    [agg_kinds] = [set(k) for k in agg["engine_steps"].values()]
    assert {"decode", "prefill"} <= agg_kinds <= {"decode", "prefill", "decode+prefill"}
    assert sorted(sorted(k) for k in disagg["engine_steps"].values()) == [["decode"], ["prefill"]]
    steps = [m for kinds in disagg["engine_steps"].values() for m in kinds.values()]
    assert all(m["steps"] >= 1 and m["mean_ms"] > 0 for m in steps)
    transfers = disagg["transfers"]  # 32 prompt tokens: two whole pages per group
    assert transfers["target"]["bytes_mean"] == 2 * page_bytes("models/tiny-target", 6)
    assert transfers["draft"]["bytes_mean"] == 2 * page_bytes("models/tiny-drafter", 1)
    assert all(t["ms_mean"] > 0 for t in transfers.values())
    table = (tmp_path / "sweep.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "C=2" in line]
    assert [r.split(" | ")[:4] for r in rows] == [
        ["| aggregated, EAGLE-3 K 4 (natural AL)", "C=2", "2", "0"],
        ["| 1P+1D, EAGLE-3 K 4 (natural AL)", "C=2", "2", "0"],
    ]
    root = ET.parse(tmp_path / "sweep.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert len([e for e in root.iter() if e.tag.endswith("polyline")]) == 4  # 2 configurations x 2 panels
    assert not any(math.isnan(v) for v in (agg["output_tok_s"], disagg["output_tok_s"]))


@pytest.mark.slow
def test_forced_acceptance_through_the_launcher_gives_exactly_n_plus_one(tmp_path):
    if "--unsafe-forced-acceptance" not in serve_sweep.worker_flags():
        pytest.skip("tandem worker does not take --unsafe-forced-acceptance in this tree")
    argv = [
        *TINY_POINT,
        "--forced-accept",
        "2",
        "--grid",
        "32/10",
        "--ceiling",
        "off",
        "--out",
        str(tmp_path),
    ]
    payload = serve_sweep.main(argv)
    assert [(p["label"], p["forced_al"], p["errors"]) for p in payload["points"]] == [
        ("aggregated, forced AL 3 (K 4)", 3, 0),
        ("1P+1D, forced AL 3 (K 4)", 3, 0),
    ]
    assert [p["acceptance_length"] for p in payload["points"]] == [3.0, 3.0]  # 9 decode tokens: 3 steps of 3
    assert serve_sweep.FORCED_NOTE in (tmp_path / "sweep.md").read_text()


def test_the_report_names_the_router_and_workers_own_flags():
    a = parse(["--device", "cpu", "--worker-args", "--stream-interval 8", "--decode-args", "--tp 2"])
    want = "\nFlags: every worker `--stream-interval 8`; decode `--tp 2`.\n"
    assert serve_sweep.flags_note(a) == want
    a = parse(["--device", "cpu", "--router-args=--no-step-streams"])
    assert serve_sweep.flags_note(a) == "\nFlags: router `--no-step-streams`.\n"
    assert serve_sweep.flags_note(parse(["--device", "cpu"])) == ""
