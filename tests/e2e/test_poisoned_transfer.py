"""A poisoned transfer: one page transfer forced to time out (a 1 s transfer timeout, the
decode worker's first receive stalled 3 s). The pair is degraded, re-paired and serves again
within seconds; the request that met it is retried and completes; no page stays held. And a
transfer that starts late (a slow prefill) is timed from its start, not from Reserve."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest

from deploy.local import LocalCluster
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from tests.e2e.conftest import cluster_args, generate, metric_sample
from tests.e2e.test_faults import wait_no_request_holds_pages

pytestmark = pytest.mark.slow
PROMPT = [1 + i % 31 for i in range(120)]  # 30 pages of 4 tokens per group: a sizeable message
TRANSFER_TIMEOUT_S = 1.0
STALL_S = 3.0  # the decode worker's first receive starts this late: its transfer times out
HEALED_WITHIN_S = 10.0


def _health(address: str) -> cpb.HealthResponse:
    with grpc.insecure_channel(address) as channel:
        return cpb_grpc.TandemStub(channel).Health(cpb.HealthRequest(), timeout=5)


def _metric(process, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(process.metrics, timeout=5).read().decode()
    return metric_sample(text, name, **labels)


def _cluster(pair, faults: str) -> LocalCluster:
    """One prefill and one decode worker with a 1 s transfer timeout and ``faults``."""
    worker, router = cluster_args(pair)
    worker += ["--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)]
    env = {"TANDEM_FAULTS": faults}
    cluster = LocalCluster(worker, router, ["prefill", "decode"], start_timeout_s=90, env=env)
    cluster.start()
    return cluster


@pytest.fixture
def poisoned(tiny_pair):
    cluster = _cluster(tiny_pair, f"decode.before_receive_once={STALL_S}")
    yield cluster
    cluster.stop()


def test_a_poisoned_transfer_degrades_the_pair_which_heals_and_serves_again(poisoned):
    router, prefill, decode = poisoned.processes
    start = time.monotonic()
    tokens, complete = generate(
        poisoned.router_address, PROMPT, 4, ignore_eos=True
    )  # met the poison, retried
    recovered_s = time.monotonic() - start
    assert len(tokens) == 4 and complete.finish_reason == cpb.FINISH_REASON_LENGTH
    assert TRANSFER_TIMEOUT_S <= recovered_s < HEALED_WITHIN_S
    assert _metric(prefill, "tandem_timeouts_total", kind="transfer") == 1.0  # the poisoned one
    assert _metric(router, "tandem_peer_registrations_total", result="healed") == 1.0
    health = _health(poisoned.router_address)
    assert (health.status, health.num_ready_pairs, health.message) == (cpb.SERVING_STATUS_SERVING, 1, "")
    for _ in range(3):  # the healed pair keeps serving
        tokens, _ = generate(poisoned.router_address, PROMPT[:40], 4, ignore_eos=True)
        assert len(tokens) == 4
    wait_no_request_holds_pages(poisoned)


def test_the_transfer_timeout_counts_from_when_the_transfer_starts_not_from_reserve(tiny_pair):
    """The prefill starts sending 1.5 s after Reserve, past the 1 s transfer timeout: the
    decode worker waits for it within the lease, then times each message from its start."""
    cluster = _cluster(tiny_pair, f"prefill.before_send={TRANSFER_TIMEOUT_S * 1.5}")
    try:
        tokens, _ = generate(cluster.router_address, PROMPT, 4, ignore_eos=True)
        assert len(tokens) == 4
        for process in cluster.processes[1:]:  # no transfer timed out (the series stays at 0)
            assert _metric(process, "tandem_timeouts_total", kind="transfer") == 0.0
        wait_no_request_holds_pages(cluster)
    finally:
        cluster.stop()
