"""Stalls and router deaths on one cluster (a router on a fixed port, one prefill and two
decode workers, 5 s leases, every prefill held 1.5 s before it sends), in order:

1. A SIGSTOPped decode worker: the requests whose Prefill was sending to it and those whose
   Reserve went to it after it stopped fail over to the other decode worker and complete,
   well before the Reserve deadline (30 s here) would have ended their wait.
2. The router killed (SIGKILL) with requests mid-transfer and reserved or decoding: once
   the leases run out, no request holds a page on any worker.
3. The router restarted on its port: the workers register again and it serves.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import grpc
import pytest

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from tests.e2e.conftest import start_cluster

pytestmark = pytest.mark.slow
LEASE_S = 5.0
HOLD_S = 1.5  # each prefill waits this long before it sends: requests stay mid-transfer
ROUTER = ("--health-timeout-s", "1", "--health-misses", "2", "--worker-call-timeout-s", "30")
CLIENT_TIMEOUT_S = 20.0  # under the Reserve deadline: only losing the worker frees a request
REQUESTS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_pair):
    lease = ["--lease-s", str(LEASE_S)]
    roles = [("prefill", lease), ("decode", lease), ("decode", lease)]
    env = {"TANDEM_FAULTS": f"prefill.before_send={HOLD_S}"}
    c = start_cluster(tiny_pair, roles, router_extra=ROUTER, port=_free_port(), env=env)
    yield c
    for p in c.processes:  # none left stopped
        if p.popen.poll() is None:
            os.kill(p.popen.pid, signal.SIGCONT)
    c.stop()


def _prompt(i: int) -> list[int]:
    return [1 + (7 * i + j) % 31 for j in range(24 + i)]  # no two share a prefix page


def _run_all(address: str, n: int, results: list) -> list[threading.Thread]:
    """``n`` requests of 6 tokens in threads; each appends its tokens or its error."""

    def one(i: int) -> None:
        try:
            results.append(_generate(address, _prompt(i)))
        except grpc.RpcError as e:
            results.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _generate(address: str, prompt: list[int]) -> tuple[int, int]:
    """One request of 6 tokens: (tokens streamed, finish reason); an error message fails."""
    request = cpb.GenerateRequest(
        token_ids=cpb.TokenIds(ids=prompt), sampling=cpb.SamplingParams(max_tokens=6, ignore_eos=True)
    )
    n, reason = 0, None
    with grpc.insecure_channel(address) as channel:
        for message in cpb_grpc.TandemStub(channel).Generate(request, timeout=CLIENT_TIMEOUT_S):
            assert not message.HasField("error"), message.error
            n += len(message.chunk.token_ids)
            reason = message.complete.finish_reason if message.HasField("complete") else reason
    return n, reason


def _held(cluster) -> dict[tuple[str, str], int]:
    """Pages a request holds (used, less what only the prefix cache holds), per worker and
    group, asked of the workers themselves (the router may be dead)."""
    held = {}
    for p in cluster.processes:
        if p.name == "router":
            continue
        stub_of = wpb_grpc.DecodeWorkerStub if p.name.startswith("decode") else wpb_grpc.PrefillWorkerStub
        with grpc.insecure_channel(p.grpc) as channel:
            stats = stub_of(channel).Stats(wpb.StatsRequest(), timeout=5)
        held |= {(p.name, g.group): g.num_pages_used - g.num_pages_cached for g in stats.groups}
    return held


def _holder(cluster, role: str, timeout_s: float = 10.0) -> str:
    """The first worker of ``role`` on which a request holds target pages."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for (name, group), n in _held(cluster).items():
            if name.startswith(role) and group == "target" and n > 0:
                return name
        time.sleep(0.02)
    raise AssertionError(f"no {role} worker holds request pages")


def _wait_no_pages_held(cluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while held := {k: n for k, n in _held(cluster).items() if n}:
        assert time.monotonic() < deadline, f"pages still held after {timeout_s} s: {held}"
        time.sleep(0.1)


def test_a_stopped_decode_workers_requests_fail_over_to_the_other(cluster):
    results: list = []
    threads = _run_all(cluster.router_address, REQUESTS, results)
    stopped = next(p for p in cluster.processes if p.name == _holder(cluster, "decode"))
    os.kill(stopped.popen.pid, signal.SIGSTOP)  # some prefills are about to send to it
    try:
        threads += _run_all(cluster.router_address, REQUESTS, results)  # some Reserve on it
        for t in threads:
            t.join(timeout=CLIENT_TIMEOUT_S + 5)
    finally:
        os.kill(stopped.popen.pid, signal.SIGCONT)
    assert results == [(6, cpb.FINISH_REASON_LENGTH)] * (2 * REQUESTS)
    _wait_no_pages_held(cluster, timeout_s=LEASE_S + 5)  # its leases end once it runs again
    cluster.wait_serving()


def test_a_killed_router_leaves_no_pages_held_once_the_leases_run_out(cluster):
    results: list = []
    threads = _run_all(cluster.router_address, REQUESTS, results)
    _holder(cluster, "prefill")  # a request mid-transfer ...
    _holder(cluster, "decode")  # ... and one reserved or decoding
    cluster.kill("router")
    for t in threads:
        t.join(timeout=10)
    assert len(results) == REQUESTS and all(isinstance(r, grpc.RpcError) for r in results)
    _wait_no_pages_held(cluster, timeout_s=LEASE_S + 5)


def test_a_restarted_router_serves_once_its_workers_register_again(cluster):
    if cluster.processes[0].popen.poll() is None:
        cluster.kill("router")
    start = time.monotonic()
    cluster.restart("router")
    cluster.wait_serving()
    print(f"router restarted: serving after {time.monotonic() - start:.2f} s")
    assert _generate(cluster.router_address, _prompt(0)) == (6, cpb.FINISH_REASON_LENGTH)
    _wait_no_pages_held(cluster, timeout_s=5)
