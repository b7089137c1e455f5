"""`tandem up`'s processes as it starts them (LocalCluster.from_args over the real parser):
every one logs through Python's logging at --log-level, in the format of
services/common/log_setup.py, into the cluster's log capture; a worker started with
--unsafe-forced-acceptance says so at start, to its peers and through the router.

Real warnings of the services, no test hook: a decode worker's reservation that expires
unused (services/decode/server.py), the router losing a killed worker (health.py)."""

from __future__ import annotations

import re
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.cli import build_parser
from deploy.local import LocalCluster
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from tests.e2e.conftest import generate
from tests.services.engine.helpers import write_pair

pytestmark = pytest.mark.slow
WAIT_S = 60.0
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
EXPIRED = "reservation of request lease-test expired: no Decode within its 0.3 s lease"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tuple(map(str, write_pair(tmp_path_factory.mktemp("pair"))))


def up(pair, *flags: str) -> LocalCluster:
    """The cluster `tandem up` starts: a prefill worker and a decode worker of TP 2 (a
    second process), the tiny random pair on the CPU."""
    argv = ["up", "--model", pair[0], "--drafter", pair[1], "-k", "3", "--tokens-per-page", "4"]
    argv += ["--kv-cache-mb", "8", "--max-num-seqs", "4", "--decode-tp", "2", "--port", "0", *flags]
    cluster = LocalCluster.from_args(build_parser().parse_args(argv))
    cluster.start_timeout_s = 120
    cluster.start()
    return cluster


def log(cluster: LocalCluster, name: str) -> str:
    return "".join(next(p for p in cluster.processes if p.name == name).log)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def expire_a_reservation(cluster: LocalCluster) -> None:
    """Reserve pages on the decode worker for a request that never comes; wait until the
    worker has counted the expired lease (it logs the warning just before)."""
    decode = next(p for p in cluster.processes if p.name == "decode-1")
    with grpc.insecure_channel(decode.grpc) as channel:
        request = wpb.ReserveRequest(request_id="lease-test", prompt_len=8, lease_ms=300)
        wpb_grpc.DecodeWorkerStub(channel).Reserve(request, timeout=30)

    def expired() -> bool:  # the labelled sample appears with its first count
        text = urllib.request.urlopen(decode.metrics, timeout=5).read().decode()
        return lease_timeouts(text) == [1.0]

    wait_for(expired, "the lease never expired")


def lease_timeouts(metrics: str) -> list[float]:
    return [
        s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "tandem_timeouts_total" and s.labels.get("kind") == "lease"
    ]


def lose_the_decode_worker(cluster: LocalCluster) -> None:
    """Kill the decode worker and wait until the router has taken it out of its pairs."""
    cluster.kill("decode-1")

    def lost() -> bool:
        with cluster.channel() as channel:
            return cpb_grpc.TandemStub(channel).Health(cpb.HealthRequest(), timeout=5).num_ready_pairs == 0

    wait_for(lost, "the router never lost the killed worker")


def test_every_process_logs_at_info_and_a_forcing_worker_says_so_everywhere(pair, monkeypatch, capfd):
    monkeypatch.setenv("TANDEM_ECHO_LOGS", "1")  # and echoes what it captures
    cluster = up(pair, "--unsafe-forced-acceptance", "1", "--max-model-len", "256")
    try:
        with cluster.channel() as channel:
            info = cpb_grpc.TandemStub(channel).ModelInfo(cpb.ModelInfoRequest(), timeout=10)
        assert (info.unsafe_forced_acceptance, info.max_model_len) == (1, 256)
        assert [w.unsafe_forced_acceptance for w in info.workers] == [1, 1]
        _, complete = generate(cluster.router_address, [1, 2, 3, 4, 5], max_tokens=16, ignore_eos=True)
        assert complete.usage.acceptance_length == 2.0  # one draft kept every step: AL 1 + 1
        for name in ("prefill-0", "decode-1"):
            assert re.search(
                rf"^{STAMP} WARNING {name} services\.worker\.serve: UNSAFE FORCED ACCEPTANCE "
                r"\(--unsafe-forced-acceptance 1\), BENCHMARKS ONLY: .* NOT the target model's$",
                log(cluster, name),
                re.M,
            ), name
        # INFO lines of each process, a TP rank's under its own id
        assert re.search(
            rf"^{STAMP} INFO router services\.router\.registry: pair prefill-0->decode-1 is ready$",
            log(cluster, "router"),
            re.M,
        )
        for who in ("prefill-0", "decode-1", "decode-1/rank1"):
            assert re.search(
                rf"^{STAMP} INFO {who} services\.engine\.setup: KV cache group target: ",
                log(cluster, who.split("/")[0]),
                re.M,
            ), who
        expire_a_reservation(cluster)
        wait_for(lambda: EXPIRED in log(cluster, "decode-1"), "no warning from the decode worker")
        assert re.search(
            rf"^{STAMP} WARNING decode-1 services\.decode\.server \[lease-test\]: {EXPIRED}$",
            log(cluster, "decode-1"),
            re.M,
        )
        lose_the_decode_worker(cluster)
        wait_for(lambda: "lost worker decode-1" in log(cluster, "router"), "no warning from the router")
        assert re.search(
            rf"^{STAMP} WARNING router services\.router\.health: lost worker decode-1: ",
            log(cluster, "router"),
            re.M,
        )
    finally:
        cluster.stop()
    echoed = capfd.readouterr().err
    assert re.search(
        rf"^\[decode-1\] {STAMP} WARNING decode-1 services\.decode\.server \[lease-test\]: {EXPIRED}$",
        echoed,
        re.M,
    )


def test_log_level_error_quiets_the_warnings_of_every_process(pair):
    cluster = up(pair, "--log-level", "ERROR")
    try:
        expire_a_reservation(cluster)
        lose_the_decode_worker(cluster)
        for name in ("router", "prefill-0", "decode-1"):
            text = log(cluster, name)
            assert not re.search(rf"^{STAMP} (INFO|WARNING) ", text, re.M), (name, text[-2000:])
        assert EXPIRED not in log(cluster, "decode-1")
    finally:
        cluster.stop()
