"""Capacity on a running cluster of the bundled target without a drafter, its workers at
``--max-model-len 1024``: the model card and ModelInfo advertise the workers' context (not
the folder's max_position_embeddings) and K = 0, and a request that can never fit is
refused at once (HTTP 400, gRPC INVALID_ARGUMENT) naming the numbers, never queued."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from deploy.local import LocalCluster
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from tests.e2e.conftest import assert_no_request_holds_pages

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models/tiny-target"
CONTEXT = 1024
WORKER = ["--model", str(MODEL), "--drafter", "none", "--kv-cache-mb", "16"]
WORKER += ["--max-model-len", str(CONTEXT), "--max-num-seqs", "8"]
ROUTER = ["--model", str(MODEL)]  # the router's own context: the folder's positions


@pytest.fixture(scope="module")
def cluster():
    cluster = LocalCluster(WORKER, ROUTER, ["prefill", "decode"], start_timeout_s=120)
    cluster.start()
    yield cluster
    cluster.stop()


def _http(cluster: LocalCluster, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(cluster.http_address + path, data=data)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_model_card_and_model_info_advertise_the_workers_context_and_no_drafts(cluster):
    folder = json.loads((MODEL / "config.json").read_text())["max_position_embeddings"]
    assert folder > CONTEXT  # else the test shows nothing
    status, models = _http(cluster, "/v1/models")
    card = models["data"][0]
    assert status == 200 and card["max_model_len"] == CONTEXT
    assert card["tandem"]["num_spec_tokens"] == 0 and card["tandem"]["drafter_id"] == ""
    assert _http(cluster, f"/v1/models/{card['id']}") == (200, card)
    with grpc.insecure_channel(cluster.router_address) as channel:
        info = cpb_grpc.TandemStub(channel).ModelInfo(cpb.ModelInfoRequest(), timeout=10)
    assert (info.max_model_len, info.num_spec_tokens) == (CONTEXT, 0)
    assert {w.max_model_len for w in info.workers} == {CONTEXT}


def test_a_request_that_can_never_fit_is_a_400_at_once_naming_the_numbers(cluster):
    body = {"model": "tiny-target", "prompt": [65] * 100, "max_tokens": 2000}
    start = time.monotonic()
    status, answer = _http(cluster, "/v1/completions", body)
    elapsed = time.monotonic() - start
    assert status == 400 and elapsed < 1.0, (status, elapsed, answer)
    message = answer["error"]["message"]
    assert "2000" in message and str(CONTEXT - 100) in message, message

    request = cpb.GenerateRequest(
        token_ids=cpb.TokenIds(ids=[65] * 100), sampling=cpb.SamplingParams(max_tokens=2000)
    )
    start = time.monotonic()
    with grpc.insecure_channel(cluster.router_address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(cpb_grpc.TandemStub(channel).Generate(request, timeout=30))
    assert time.monotonic() - start < 1.0
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2000" in refused.value.details() and str(CONTEXT) in refused.value.details()
    assert_no_request_holds_pages(cluster)


def test_a_request_at_the_context_is_served(cluster):
    body = {"model": "tiny-target", "prompt": [65] * 100, "max_tokens": 4, "temperature": 0}
    status, answer = _http(cluster, "/v1/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] <= 4, answer
    at_context = {"prompt": [65] * (CONTEXT - 4), "max_tokens": 4, "ignore_eos": True}
    status, answer = _http(cluster, "/v1/completions", body | at_context)
    assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer
    assert_no_request_holds_pages(cluster)
