"""A real Prometheus server scrapes a real local cluster (the path `make observe` takes)."""

from __future__ import annotations

import re
import shutil
import socket
import time

import grpc
import pytest

from deploy.grafana.panels import ROWS
from deploy.prometheus.observe import Prometheus, file_sd, parse_endpoints, start_tandem_up, stop_tandem_up
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from tests.services.engine.helpers import write_pair

FAILURE_ONLY = {"Transfer failures by group"}
"""Panels with data only after a fault of their kind (tests/e2e/test_poisoned_transfer.py
checks that counter); the live test triggers the others' (a lease expiry)."""
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9],
    [1, 2, 3, 4, 5, 6, 7, 8, 10],
    [1, 2, 3, 4, 5, 6, 7, 8, 11],
    [9, 9, 9, 9],
]

SUMMARY = """tandem local cluster (Ctrl-C stops it):
router       grpc=127.0.0.1:50051  metrics=http://127.0.0.1:40001/metrics
prefill-0    grpc=127.0.0.1:40003  metrics=http://127.0.0.1:40002/metrics
decode-1     grpc=127.0.0.1:40005  metrics=http://127.0.0.1:40004/metrics
clients: gRPC tandem.v1.Tandem at 127.0.0.1:50051
""".splitlines(keepends=True)
_CLIENTS = re.compile(r"^clients: gRPC tandem\.v1\.Tandem at (\S+)")


def test_summary_lines_become_file_sd_targets_with_process_and_role():
    assert file_sd(parse_endpoints(SUMMARY)) == [
        {"targets": ["127.0.0.1:40001"], "labels": {"process": "router", "role": "router"}},
        {"targets": ["127.0.0.1:40002"], "labels": {"process": "prefill-0", "role": "prefill"}},
        {"targets": ["127.0.0.1:40004"], "labels": {"process": "decode-1", "role": "decode"}},
    ]


def test_a_metrics_path_other_than_the_default_is_kept():
    (group,) = file_sd({"both-0": "http://127.0.0.1:9/stats"})
    assert group["labels"] == {"process": "both-0", "role": "both", "__metrics_path__": "/stats"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(prometheus: Prometheus, expr: str, timeout_s: float = 40.0) -> list[dict]:
    """Query until the result is non-empty (a scrape happens every 2 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = prometheus.query(expr)
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"{expr}: no result after {timeout_s} s")


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="Debian's prometheus is not installed (deploy/prometheus/install.sh "
    "or `make observe` installs it)",
)
def test_prometheus_scrapes_a_live_metric_from_tandem_up(tmp_path):
    target, drafter = write_pair(tmp_path / "pair")
    cluster, summary = start_tandem_up(
        [
            "--port",
            "0",
            "--http-port",
            "-1",
            "--model",
            str(target),
            "--drafter",
            str(drafter),
            "-k",
            "3",
            "--tokens-per-page",
            "4",
            "--kv-cache-mb",
            "8",
            "--max-num-seqs",
            "8",
        ],
        echo=False,
    )
    prometheus = Prometheus(str(tmp_path), free_port())
    try:
        prometheus.start(parse_endpoints(summary))
        (router,) = [m.group(1) for m in map(_CLIENTS.match, summary) if m]
        mixed_load(router, summary)
        up = wait_for(prometheus, 'count(up{job="tandem"} == 1) == 3')
        assert up[0]["value"][1] == "3"
        finished = wait_for(prometheus, 'sum(tandem_requests_total{role="router", process="router"})')
        assert finished[0]["value"][1] == str(len(PROMPTS) + 1)  # the cancelled one ends too
        pages = wait_for(prometheus, 'tandem_kv_pages_total{role="decode"}')
        assert sorted(s["metric"]["group"] for s in pages) == ["draft", "target"]
        wait_for(prometheus, 'tandem_timeouts_total{kind="lease"} > 0')
        steps = wait_for(prometheus, "tandem_engine_step_seconds_count > 0")
        kinds = {(s["metric"]["role"], s["metric"]["kind"]) for s in steps}
        assert {("prefill", "prefill"), ("decode", "decode")} <= kinds, kinds  # CPU: decode-first
        assert all(kind != "mixed" for _, kind in kinds), kinds
        time.sleep(4)  # two more scrapes: every rate() has two samples since the load
        empty = [(title, expr) for title, expr in dashboard_queries() if not prometheus.query(live(expr))]
        assert empty == [], empty
    finally:
        prometheus.stop()
        stop_tandem_up(cluster)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, query) of every panel that has data without a fault."""
    return [
        (p.title, q[0]) for row in ROWS for p in row.panels for q in p.queries if p.title not in FAILURE_ONLY
    ]


def live(expr: str) -> str:
    """A dashboard query as Grafana would send it for this Prometheus (2 s scrapes)."""
    return expr.replace("$job", "tandem").replace("$__rate_interval", "30s")


def mixed_load(router: str, summary: list[str]) -> None:
    """Requests sharing a prefix (prefix-cache hits), one cancelled mid-stream, and one
    Reserve left to expire on the decode worker (a lease timeout)."""
    with grpc.insecure_channel(router) as channel:
        stub = cpb_grpc.TandemStub(channel)
        for prompt in PROMPTS:
            request = cpb.GenerateRequest(
                token_ids=cpb.TokenIds(ids=prompt), sampling=cpb.SamplingParams(max_tokens=6)
            )
            kinds = [m.WhichOneof("payload") for m in stub.Generate(request, timeout=60)]
            assert kinds[-1] == "complete"
        long = cpb.GenerateRequest(
            token_ids=cpb.TokenIds(ids=PROMPTS[0]),
            sampling=cpb.SamplingParams(max_tokens=200, ignore_eos=True),
        )
        call = stub.Generate(long, timeout=60)
        next(call)
        call.cancel()
    decode = next(line.split("grpc=")[1].split()[0] for line in summary if line.startswith("decode"))
    with grpc.insecure_channel(decode) as channel:
        reserve = wpb.ReserveRequest(request_id="left-to-expire", prompt_len=4, lease_ms=300)
        wpb_grpc.DecodeWorkerStub(channel).Reserve(reserve, timeout=10)
