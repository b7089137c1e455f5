"""The logs an operator reads, from a real cluster in the JSON format: one line per finished
request on the router, a stats line per worker, and the request's id on every process's
lines about it (a gRPC request_id; an HTTP X-Request-Id, echoed); every log line is JSON."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from proto.tandem.v1 import client_pb2 as cpb
from tests.e2e.conftest import start_cluster, stream

pytestmark = pytest.mark.slow
WAIT_S = 20.0


@pytest.fixture(scope="module")
def cluster(tiny_pair):
    flags = ("--log-format", "json", "--log-stats-interval-s", "0.3")
    c = start_cluster(tiny_pair, ["prefill", "decode"], router_extra=flags, worker_extra=flags)
    yield c
    c.stop()


def records(cluster, name: str) -> list[dict]:
    """The process's log lines, parsed (each must be a JSON object); the endpoints line,
    which is no log record, is left out."""
    process = next(p for p in cluster.processes if p.name == name)
    out = []
    for line in list(process.log):
        if " grpc=" in line and " metrics=" in line and not line.startswith("{"):
            continue
        out.append(json.loads(line))
    return out


def wait_for(check, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.1)
    raise AssertionError(what)


def about(cluster, name: str, rid: str) -> list[dict]:
    return [r for r in records(cluster, name) if r.get("request_id") == rid]


def test_a_grpc_request_is_one_router_line_and_its_id_is_on_every_process(cluster):
    request = cpb.GenerateRequest(
        request_id="ops-grpc-1",
        token_ids=cpb.TokenIds(ids=[5, 6, 7, 8, 9]),
        sampling=cpb.SamplingParams(max_tokens=12, ignore_eos=True),
    )
    tokens, _, complete = stream(cluster.router_address, request)
    line = wait_for(
        lambda: [r for r in about(cluster, "router", "ops-grpc-1") if r.get("status")], "no request line"
    )
    assert len(line) == 1, line
    line = line[0]
    assert line["level"] == "INFO" and line["process"] == "router"
    assert line["status"] == "length" and line["completion_tokens"] == len(tokens) == 12
    assert line["prompt_tokens"] == 5 and line["ttft_s"] > 0 and line["e2e_s"] >= line["ttft_s"]
    assert line["workers"] == "prefill-0 -> decode-1"
    assert line["acceptance_length"] == pytest.approx(complete.usage.acceptance_length, abs=1e-3)
    assert line["message"].startswith("request ops-grpc-1 length: prompt 5")
    for worker in ("prefill-0", "decode-1"):
        assert wait_for(lambda w=worker: about(cluster, w, "ops-grpc-1"), f"{worker}: no line about it")


def test_x_request_id_names_the_http_request_and_is_echoed(cluster):
    body = json.dumps({"model": "target", "prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True})
    http = urllib.request.Request(
        cluster.http_address + "/v1/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": "ops-http-7"},
    )
    with urllib.request.urlopen(http, timeout=30) as response:
        assert response.headers["X-Request-Id"] == "ops-http-7"
        assert json.load(response)["id"] == "cmpl-ops-http-7"
    rid = "cmpl-ops-http-7"
    line = wait_for(lambda: [r for r in about(cluster, "router", rid) if r.get("status")], "no request line")
    assert line[0]["status"] == "length" and line[0]["completion_tokens"] == 6
    for worker in ("prefill-0", "decode-1"):
        assert wait_for(lambda w=worker: about(cluster, w, rid), f"{worker}: no line about it")
    plain = urllib.request.Request(
        cluster.http_address + "/v1/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(plain, timeout=30) as response:
        assert response.headers["X-Request-Id"] == json.load(response)["id"]


def test_every_worker_logs_stats_while_it_works_and_every_line_is_json(cluster):
    request = cpb.GenerateRequest(
        token_ids=cpb.TokenIds(ids=[i % 30 + 1 for i in range(37)]),
        sampling=cpb.SamplingParams(max_tokens=40, ignore_eos=True),
    )
    stream(cluster.router_address, request)
    for worker in ("prefill-0", "decode-1"):
        stats = wait_for(
            lambda w=worker: [r for r in records(cluster, w) if r["message"].startswith("stats: ")],
            f"{worker}: no stats line",
        )
        assert {"running", "waiting", "kv_usage_percent", "generation_tokens_per_s"} <= stats[0].keys()
        assert set(stats[0]["kv_usage_percent"]) == {"target", "draft"}
    assert any(
        r["generation_tokens_per_s"] > 0 for r in records(cluster, "decode-1") if "stats: " in r["message"]
    )
    assert any(
        r["prompt_tokens_per_s"] > 0 for r in records(cluster, "prefill-0") if "stats: " in r["message"]
    )
    for name in ("router", "prefill-0", "decode-1"):
        lines = records(cluster, name)
        assert lines and all({"time", "level", "process", "logger", "message"} <= r.keys() for r in lines)
