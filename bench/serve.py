"""`make bench-serve`: aiperf against a local cluster, its summary as a markdown table; with
``sweep`` first, the served-load sweep instead (``bench/serve_sweep.py``).

    python -m bench.serve [aiperf] [--concurrency 4 ...]   # aiperf, the bundled pair, CPU
    python -m bench.serve sweep [--device cuda|cpu ...]     # the sweep: python -m bench.serve sweep -h

Starts ``tandem up`` with the bundled pair (router, one prefill and one decode worker on
127.0.0.1), runs ``aiperf profile`` on the OpenAI completions endpoint with the bundled
tokenizer (loaded offline from its folder), streaming, and prints the table that
docs/performance.md records. aiperf runs from its own virtual environment (``--aiperf``, by
default ``.venv-aiperf/bin/aiperf``, made with ``pip install aiperf==AIPERF_VERSION`` when
missing), so its dependencies never meet the cluster's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench import serve_sweep
from deploy.local import LocalCluster

AIPERF_VERSION = "0.13.0"
MODEL, DRAFTER = "models/tiny-target", "models/tiny-drafter"
ROUTER_LATENCIES = ("tandem_inter_token_latency_seconds", "tandem_inter_chunk_latency_seconds")
METRICS = (
    ("time_to_first_token", "time to first token (ms)"),
    ("inter_token_latency", "inter-token latency (ms)"),
    ("request_latency", "request latency (ms)"),
    ("output_token_throughput_per_user", "output tokens/s per user"),
)


def aiperf_binary(path: str) -> str:
    """``path`` if it exists, else aiperf installed into ``.venv-aiperf`` (once)."""
    if Path(path).exists():
        return path
    venv = Path(".venv-aiperf")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin/pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True)
    return str(venv / "bin/aiperf")


def profile(aiperf: str, url: str, args: argparse.Namespace, artifacts: Path) -> dict:
    """Run aiperf once; returns its summary export (profile_export_aiperf.json)."""
    command = [
        aiperf, "profile", "--model", "tiny-target", "--url", url, "--endpoint-type", "completions",
        "--tokenizer", MODEL, "--streaming", "--concurrency", str(args.concurrency),
        "--request-count", str(args.requests), "--isl", str(args.isl), "--osl", str(args.osl),
        "--extra-inputs", "ignore_eos:true", "--random-seed", "0", "--ui-type", "none",
        "--artifact-dir", str(artifacts),
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    (export,) = artifacts.rglob("profile_export_aiperf.json")
    return json.loads(export.read_text())


def metric(summary: dict, name: str) -> dict:
    """One metric's statistics, wherever the export version keeps them."""
    for holder in (summary, summary.get("records", {}), summary.get("metrics", {})):
        if isinstance(holder, dict) and isinstance(holder.get(name), dict):
            return holder[name]
    if isinstance(summary.get("records"), list):
        for record in summary["records"]:
            if record.get("tag") == name:
                return record
    return {}


def table(summary: dict) -> str:
    rows = ["| metric | avg | p50 | p90 | p99 |", "|---|---|---|---|---|"]
    for name, label in METRICS:
        m = metric(summary, name)
        rows.append(
            f"| {label} | " + " | ".join(_number(m.get(s)) for s in ("avg", "p50", "p90", "p99")) + " |"
        )
    return "\n".join(rows)


def _number(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def main(argv: list[str] | None = None) -> None:
    """``sweep ...``: bench.serve_sweep; ``aiperf ...`` or no subcommand: aiperf."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sweep"]:
        serve_sweep.main(argv[1:])
        return
    aiperf_main(argv[1:] if argv[:1] == ["aiperf"] else argv)


def aiperf_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve [aiperf]", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--aiperf", default=".venv-aiperf/bin/aiperf", help="the aiperf executable")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--isl", type=int, default=128, help="input tokens per request")
    parser.add_argument("--osl", type=int, default=64, help="output tokens per request")
    parser.add_argument("-k", type=int, default=4)
    args = parser.parse_args(argv)
    aiperf = aiperf_binary(args.aiperf)
    cluster = LocalCluster(
        ["--model", MODEL, "--drafter", DRAFTER, "-k", str(args.k)],
        ["--model", MODEL, "-k", str(args.k)],
        ["prefill", "decode"],
    )
    cluster.start()
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as artifacts:
            summary = profile(aiperf, cluster.http_address, args, Path(artifacts))
        scraped = urllib.request.urlopen(cluster.processes[0].metrics, timeout=10).read().decode()
    finally:
        cluster.stop()
    count = metric(summary, "request_count").get("avg")
    print(
        f"aiperf {AIPERF_VERSION}, bundled pair (K = {args.k}), completions, streaming, concurrency "
        f"{args.concurrency}, {args.requests} requests, {args.isl} in / {args.osl} out tokens "
        f"(ignore_eos), seed 0: {count if count is not None else '?'} completed, "
        f"{_number(metric(summary, 'output_token_throughput').get('avg'))} output tok/s, "
        f"{_number(metric(summary, 'request_throughput').get('avg'))} requests/s "
        f"({time.monotonic() - start:.0f} s)"
    )
    print(table(summary))
    print(
        "the router's own histograms, mean: "
        + ", ".join(f"{name} {histogram_mean(scraped, name) * 1000:.1f} ms" for name in ROUTER_LATENCIES)
    )


def histogram_mean(text: str, name: str) -> float:
    """sum / count of the router's (role="router") histogram ``name`` in a /metrics page."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (f"{name}_sum", f"{name}_count") and sample.labels.get("role") == "router":
                values[sample.name.rsplit("_", 1)[1]] = sample.value
    return values.get("sum", 0.0) / values["count"] if values.get("count") else float("nan")


if __name__ == "__main__":
    main()
