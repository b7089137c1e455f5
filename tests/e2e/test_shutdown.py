"""Graceful shutdown of real processes, mid-stream (engine steps slowed so a stream lasts
seconds): SIGTERM to the router or to a worker lets the stream finish, or ends it with an
error naming the shutdown timeout once that passes; the process exits 0 within the
timeout, no request holds pages afterwards, and ``LocalCluster.stop`` (what ``tandem up``
runs) loses no request in flight and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from tests.e2e.conftest import assert_no_request_holds_pages, cluster_args, start_cluster

pytestmark = pytest.mark.slow
SLOW = {"TANDEM_FAULTS": "engine.step=0.05"}  # a 40-token stream takes about 2 s
WAIT_S = 20.0


def request(max_tokens: int) -> cpb.GenerateRequest:
    return cpb.GenerateRequest(
        token_ids=cpb.TokenIds(ids=[5, 6, 7, 8, 9, 10]),
        sampling=cpb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def process(cluster, name: str):
    return next(p for p in cluster.processes if p.name == name)


def log(cluster, name: str) -> str:
    return "".join(process(cluster, name).log)


def wait_for(check, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.05)
    raise AssertionError(what)


def rest_of(responses) -> tuple[int, str, cpb.Complete | None]:
    """(tokens, error message, complete) of the rest of a stream."""
    tokens, error, complete = 0, "", None
    for message in responses:
        kind = message.WhichOneof("payload")
        if kind == "chunk":
            tokens += len(message.chunk.token_ids)
        elif kind == "error":
            error = message.error.message
        else:
            complete = message.complete
    return tokens, error, complete


def started(stub) -> tuple[object, int]:
    """A 40-token stream, once its second chunk came (the first is the prefill's, sent
    before the pages move; the second the decode stream's): (the rest of it, tokens so far)."""
    responses = stub.Generate(request(40), timeout=60)
    head = [next(responses), next(responses)]
    assert [m.WhichOneof("payload") for m in head] == ["chunk", "chunk"], head
    return responses, sum(len(m.chunk.token_ids) for m in head)


def not_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return answer.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_sigterm_to_the_router_mid_stream_finishes_it_refuses_new_requests_and_exits(tiny_pair):
    cluster = start_cluster(
        tiny_pair, ["prefill", "decode"], router_extra=("--shutdown-timeout-s", "20"), env=SLOW
    )
    try:
        router = process(cluster, "router")
        with grpc.insecure_channel(cluster.router_address) as channel:
            stub = cpb_grpc.TandemStub(channel)
            responses, first = started(stub)
            router.popen.send_signal(signal.SIGTERM)
            wait_for(lambda: not_serving(cluster.router_address), "health still SERVING")
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request(4), timeout=10))
            tokens, error, complete = rest_of(responses)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "router is shutting down" in refused.value.details()
        assert not error and complete.finish_reason == cpb.FINISH_REASON_LENGTH and first + tokens == 40
        assert router.popen.wait(timeout=WAIT_S) == 0
        assert "shutdown: 1 requests finished, 0 cut short" in log(cluster, "router")
        wait_for(lambda: _no_pages_held(cluster), "a worker still holds pages")
    finally:
        cluster.stop()


def test_the_router_past_its_shutdown_timeout_ends_the_stream_with_an_error_and_exits(tiny_pair):
    cluster = start_cluster(
        tiny_pair, ["prefill", "decode"], router_extra=("--shutdown-timeout-s", "0.5"), env=SLOW
    )
    try:
        router = process(cluster, "router")
        with grpc.insecure_channel(cluster.router_address) as channel:
            responses, _ = started(cpb_grpc.TandemStub(channel))
            sent = time.monotonic()
            router.popen.send_signal(signal.SIGTERM)
            tokens, error, complete = rest_of(responses)
        assert "router shut down" in error and "shutdown timeout (0.5 s" in error, error
        assert complete.finish_reason == cpb.FINISH_REASON_ERROR
        assert router.popen.wait(timeout=WAIT_S) == 0 and time.monotonic() - sent < 10
        assert "shutdown timeout: cutting 1 requests short" in log(cluster, "router")
        wait_for(lambda: _no_pages_held(cluster), "a worker still holds pages")
    finally:
        cluster.stop()


def test_sigterm_to_the_decode_worker_mid_stream_finishes_it_then_it_deregisters_and_exits(tiny_pair):
    cluster = start_cluster(
        tiny_pair, ["prefill", "decode"], worker_extra=("--shutdown-timeout-s", "20"), env=SLOW
    )
    try:
        decode = process(cluster, "decode-1")
        with grpc.insecure_channel(cluster.router_address) as channel:
            stub = cpb_grpc.TandemStub(channel)
            responses, first = started(stub)
            decode.popen.send_signal(signal.SIGTERM)
            tokens, error, complete = rest_of(responses)
            assert not error and complete.finish_reason == cpb.FINISH_REASON_LENGTH and first + tokens == 40
            assert decode.popen.wait(timeout=WAIT_S) == 0
            health = stub.Health(cpb.HealthRequest(), timeout=5)
        text = log(cluster, "decode-1")
        assert "shutting down: deregistered; 1 request calls in flight" in text
        assert "pages still held by requests: 0" in text
        assert health.num_decode_workers == 0 and "worker decode-1 is draining" in log(cluster, "router")
        assert "lost worker decode-1" not in log(cluster, "router")  # it said goodbye
        wait_for(lambda: _no_pages_held(cluster), "the prefill worker still holds pages")
    finally:
        cluster.stop()


def test_a_worker_past_its_shutdown_timeout_fails_the_stream_with_a_clear_error_and_frees_its_pages(
    tiny_pair,
):
    cluster = start_cluster(
        tiny_pair, ["prefill", "decode"], worker_extra=("--shutdown-timeout-s", "0.3"), env=SLOW
    )
    try:
        decode = process(cluster, "decode-1")
        with grpc.insecure_channel(cluster.router_address) as channel:
            responses, _ = started(cpb_grpc.TandemStub(channel))
            decode.popen.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as ended:  # a worker gone mid-stream: the RPC's status
                rest_of(responses)
        error = ended.value.details()
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "worker decode-1 shut down" in error and "shutdown timeout (0.3 s" in error, error
        assert decode.popen.wait(timeout=WAIT_S) == 0
        assert "pages still held by requests: 0" in log(cluster, "decode-1")
        wait_for(lambda: _no_pages_held(cluster), "the prefill worker still holds pages")
    finally:
        cluster.stop()


def test_stopping_the_cluster_mid_stream_loses_no_request_and_leaves_no_process(tiny_pair):
    cluster = start_cluster(tiny_pair, ["prefill", "decode"], env=SLOW)
    outcome = {}
    try:
        with grpc.insecure_channel(cluster.router_address) as channel:
            responses, first = started(cpb_grpc.TandemStub(channel))
            reader = threading.Thread(target=lambda: outcome.update(rest=rest_of(responses)))
            reader.start()
            cluster.stop()  # routers first: the stream finishes before any worker is told to stop
            reader.join(timeout=WAIT_S)
    finally:
        cluster.stop()
    tokens, error, complete = outcome["rest"]
    assert not error and complete.finish_reason == cpb.FINISH_REASON_LENGTH and first + tokens == 40
    assert [p.popen.returncode for p in cluster.processes] == [0, 0, 0]
    assert not _processes_naming(str(tiny_pair[0]))


def _no_pages_held(cluster) -> bool:
    try:
        assert_no_request_holds_pages(cluster)
    except AssertionError:
        return False
    return True


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_sigterm_to_an_aggregated_worker_mid_stream_finishes_it(tiny_pair):
    cluster = start_cluster(tiny_pair, ["both"], worker_extra=("--shutdown-timeout-s", "20"), env=SLOW)
    try:
        worker = process(cluster, "both-0")
        with grpc.insecure_channel(cluster.router_address) as channel:
            responses, first = started(cpb_grpc.TandemStub(channel))
            worker.popen.send_signal(signal.SIGTERM)
            tokens, error, complete = rest_of(responses)
        assert not error and complete.finish_reason == cpb.FINISH_REASON_LENGTH and first + tokens == 40
        assert worker.popen.wait(timeout=WAIT_S) == 0
        assert "pages still held by requests: 0" in log(cluster, "both-0")
    finally:
        cluster.stop()


def test_tandem_up_on_sigterm_stops_every_process_and_exits_0(tiny_pair):
    worker, _ = cluster_args(tiny_pair)
    up = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "up", "--port", "0", *worker, "--shutdown-timeout-s", "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        for line in up.stdout:
            if line.startswith("tandem local cluster"):
                break
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=WAIT_S) == 0
        wait_for(
            lambda: not _processes_naming(str(tiny_pair[0])), "a process of the cluster is still running"
        )
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
