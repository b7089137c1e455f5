"""The cluster as clients and operators see it: refusals, health, metrics, bad input, retries."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from tests.e2e.conftest import (
    assert_no_request_holds_pages,
    cluster_args,
    generate,
    metric_sample,
    start_cluster,
)

pytestmark = pytest.mark.slow
PROMPT = list(range(1, 21))


@pytest.fixture(scope="module")
def mixed(tiny_pair):
    """One prefill, one matching decode, and one decode with another K (refused)."""
    cluster = start_cluster(tiny_pair, ["prefill", "decode", ("decode", ["-k", "2"])], expected_pairs=1)
    _wait_no_pair_pending(cluster)
    yield cluster
    cluster.stop()


def _wait_no_pair_pending(cluster, timeout_s: float = 30.0) -> None:
    """The cluster counts as started once one pair is READY; the other may still be pairing."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = cpb_grpc.TandemStub(channel)
        while any(p.state == "pending" for p in stub.Health(cpb.HealthRequest(), timeout=5).pairs):
            assert time.monotonic() < deadline, "a pair still pending"
            time.sleep(0.2)


def test_a_mismatched_pair_is_refused_naming_the_field_and_both_values(mixed):
    with grpc.insecure_channel(mixed.router_address) as channel:
        health = cpb_grpc.TandemStub(channel).Health(cpb.HealthRequest(), timeout=5)
    assert health.status == cpb.SERVING_STATUS_SERVING
    assert health.num_ready_pairs == 1
    assert health.message.startswith("prefill-0->decode-2: ")
    router = mixed.processes[0]
    text = urllib.request.urlopen(router.metrics, timeout=5).read().decode()
    assert metric_sample(text, "tandem_peer_registrations_total", result="refused") == 1.0


def test_the_refusal_names_num_spec_tokens_with_both_values(mixed):
    reason = _pair_reason(mixed, "prefill-0", "decode-2")
    assert "num_spec_tokens" in reason and "3" in reason and "2" in reason


def test_traffic_goes_only_to_the_ready_pair(mixed):
    for _ in range(3):
        tokens, complete = generate(mixed.router_address, PROMPT, 8, temperature=0)
        assert len(tokens) == 8
    pages = _decode_requests_seen(mixed)
    assert pages["decode-2"] == 0 and pages["decode-1"] > 0
    assert_no_request_holds_pages(mixed)


def test_readiness_means_registered_and_paired(mixed):
    expected = {"router": True, "prefill-0": True, "decode-1": True, "decode-2": False}
    deadline = time.monotonic() + 5  # workers report readiness with their 1 s heartbeat
    while True:
        ready = {p.name: _ready(p.grpc) for p in mixed.processes}
        if ready == expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ready == expected


def _ready(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        status = (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service="tandem.ready"), timeout=5)
            .status
        )
    return status == health_pb2.HealthCheckResponse.SERVING


def test_every_process_serves_grpc_health_and_metrics(mixed):
    for p in mixed.processes:
        with grpc.insecure_channel(p.grpc) as channel:
            status = (
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            )
        assert status == health_pb2.HealthCheckResponse.SERVING, p.name
        text = urllib.request.urlopen(p.metrics, timeout=5).read().decode()
        assert "tandem_requests_total" in text or "tandem_peer_registrations_total" in text
    generate(mixed.router_address, PROMPT, 8, temperature=0)
    prefill = urllib.request.urlopen(mixed.processes[1].metrics, timeout=5).read().decode()
    for group in ("target", "draft"):
        assert metric_sample(prefill, "tandem_kv_transfer_bytes_total", group=group) > 0


IDS = cpb.TokenIds(ids=[1, 2])


@pytest.mark.parametrize(
    "request_kwargs, field",
    [
        (dict(), "prompt"),
        (dict(text=""), "prompt"),
        (dict(token_ids=cpb.TokenIds(ids=[])), "prompt.token_ids"),
        (dict(token_ids=cpb.TokenIds(ids=[1, 99])), "prompt.token_ids"),
        (dict(token_ids=IDS, sampling=cpb.SamplingParams(temperature=-1)), "sampling.temperature"),
        (dict(token_ids=IDS, sampling=cpb.SamplingParams(top_p=2)), "sampling.top_p"),
        (dict(token_ids=IDS, sampling=cpb.SamplingParams(max_tokens=100000)), "sampling.max_tokens"),
        (dict(token_ids=IDS, sampling=cpb.SamplingParams(stop=[""])), "sampling.stop[0]"),
        (
            dict(token_ids=IDS, speculative=cpb.SpeculativeOptions(num_spec_tokens=9)),
            "speculative.num_spec_tokens",
        ),
    ],
)
def test_bad_requests_get_invalid_argument_naming_the_field(mixed, request_kwargs, field):
    with grpc.insecure_channel(mixed.router_address) as channel:
        stub = cpb_grpc.TandemStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Generate(cpb.GenerateRequest(**request_kwargs), timeout=10))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(field)
    tokens, _ = generate(mixed.router_address, PROMPT, 4, temperature=0)  # still serving
    assert len(tokens) == 4


def test_a_reserved_prompt_is_checked_and_decode_must_send_the_same(mixed):
    decode = next(p for p in mixed.processes if p.name.startswith("decode"))
    prefill = next(p for p in mixed.processes if p.name.startswith("prefill"))
    with grpc.insecure_channel(decode.grpc) as channel:
        stub = wpb_grpc.DecodeWorkerStub(channel)
        for ids, field in (
            ([1, 2, 3], "prompt_token_ids: 3 tokens, prompt_len is 5"),
            ([1, 2, 3, 4, 99], "prompt_token_ids: 99 is outside"),
        ):
            with pytest.raises(grpc.RpcError) as raised:
                stub.Reserve(
                    wpb.ReserveRequest(request_id="p", prompt_len=5, prompt_token_ids=ids), timeout=10
                )
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert raised.value.details().startswith(field)
        stub.Reserve(wpb.ReserveRequest(request_id="p", prompt_len=3, prompt_token_ids=[1, 2, 3]), timeout=10)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Decode(wpb.DecodeRequest(request_id="p", prompt_token_ids=[1, 2, 4]), timeout=10))
        assert raised.value.details() == "prompt_token_ids: differ from the tokens reserved"
        assert stub.Release(wpb.ReleaseRequest(request_id="p"), timeout=10).released
    bad = wpb.PrefillRequest(
        request_id="q",
        prompt_token_ids=[1, 2],
        reservation=wpb.Reservation(
            decode_instance_id=decode.name, groups=[wpb.GroupPages(group="target", page_ids=[0], num_held=2)]
        ),
    )
    with grpc.insecure_channel(prefill.grpc) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            list(wpb_grpc.PrefillWorkerStub(channel).Prefill(bad, timeout=10))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "reservation.groups[0].num_held: 2 of 1 pages"
    assert_no_request_holds_pages(mixed)


def test_slow_health_answers_keep_traffic_within_the_routers_health_timeout(tiny_pair):
    """Every Stats answer takes 2.5 s: past the default 2 s deadline (two misses would drop the
    workers within about 5 s), within --health-timeout-s 4."""
    cluster = start_cluster(
        tiny_pair,
        ["prefill", "decode"],
        env={"TANDEM_FAULTS": "worker.stats=2.5"},
        router_extra=("--health-timeout-s", "4", "--health-misses", "2"),
    )
    try:
        time.sleep(8)  # several polls of each worker
        with cluster.channel() as channel:
            assert cpb_grpc.TandemStub(channel).Health(cpb.HealthRequest(), timeout=5).num_ready_pairs == 1
        tokens, _ = generate(cluster.router_address, PROMPT, 4)
        assert len(tokens) == 4
    finally:
        cluster.stop()


def test_unified_layout_without_a_drafter_fails_at_startup(tiny_pair):
    worker, _ = cluster_args(tiny_pair)
    worker[worker.index("--drafter") + 1] = "none"
    result = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "worker", "--role", "decode", *worker],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "tandem: layout: unified" in result.stderr and "no drafter" in result.stderr


def test_a_dead_prefill_worker_is_retried_around(tiny_pair):
    cluster = start_cluster(tiny_pair, ["prefill", "prefill", "decode"])
    try:
        cluster.kill("prefill-0")
        for _ in range(4):
            tokens, complete = generate(cluster.router_address, PROMPT, 6, temperature=0)
            assert len(tokens) == 6
            assert complete.finish_reason == cpb.FINISH_REASON_LENGTH
    finally:
        cluster.stop()


def _pair_reason(cluster, prefill: str, decode: str) -> str:
    with grpc.insecure_channel(cluster.router_address) as channel:
        health = cpb_grpc.TandemStub(channel).Health(cpb.HealthRequest(), timeout=5)
    return health.message if f"{prefill}->{decode}" in health.message else ""


def _decode_requests_seen(cluster) -> dict[str, float]:
    out = {}
    for p in cluster.processes:
        if p.name.startswith("decode"):
            text = urllib.request.urlopen(p.metrics, timeout=5).read().decode()
            out[p.name] = sum(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("tandem_requests_total{") and 'role="decode"' in line
            )
    return out


def test_model_info_shows_clients_no_worker_address(mixed):
    with grpc.insecure_channel(mixed.router_address) as channel:
        workers = cpb_grpc.TandemStub(channel).ModelInfo(cpb.ModelInfoRequest(), timeout=5).workers
    assert sorted(w.instance_id for w in workers) == ["decode-1", "decode-2", "prefill-0"]
    assert all(not w.grpc_address and not w.HasField("transfer_endpoint") for w in workers)
    assert all(w.groups and w.tokens_per_page for w in workers)  # the geometry stays


def test_a_live_workers_registration_cannot_be_replaced_by_another_caller(mixed):
    """Without credentials every caller has the same identity: a Register of the live
    decode-1 at its own address, with a garbled transfer address, would have taken its place
    (its pair FAILED for good). The router asks the worker at that address, which reports
    its own RankInfo: refused, naming what differs; the pair keeps serving."""
    decode = next(p for p in mixed.processes if p.name == "decode-1")
    with grpc.insecure_channel(decode.grpc) as channel:  # an attacker reaching a worker's port
        forged = wpb_grpc.DecodeWorkerStub(channel).Stats(wpb.StatsRequest(), timeout=5).rank_info
    forged.transfer_endpoint.address = b"\x00" * len(forged.transfer_endpoint.address)
    with grpc.insecure_channel(mixed.router_address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            reg_grpc.RegistrationStub(channel).Register(reg.RegisterRequest(rank_info=forged), timeout=10)
        health = cpb_grpc.TandemStub(channel).Health(cpb.HealthRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details() == (
        f"rank_info: transfer_endpoint differ from what the live worker 'decode-1' at "
        f"{forged.grpc_address} reports"
    )
    assert (health.status, health.num_ready_pairs) == (cpb.SERVING_STATUS_SERVING, 1)
    tokens, _ = generate(mixed.router_address, PROMPT, 4, temperature=0)
    assert len(tokens) == 4
