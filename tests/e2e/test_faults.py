"""Injected faults: cancellations in each phase, an expired lease, dead workers.

In every case the surviving workers' pools end with no request holding a page."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from tests.e2e.conftest import generate, metric_sample, start_cluster, worker_pages

pytestmark = pytest.mark.slow
PROMPT = list(range(1, 30))
SETTLE_S = 5.0


def wait_no_request_holds_pages(cluster, timeout_s: float = SETTLE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        pages = worker_pages(cluster)
        held = {(w, g): u for w, groups in pages.items() for g, u in groups.items() if u[0] != u[1]}
        if not held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pages still held after {timeout_s} s: {held}")
        time.sleep(0.1)


def stream(address: str, prompt: list[int], max_tokens: int, rid: str = ""):
    channel = grpc.insecure_channel(address)
    request = cpb.GenerateRequest(
        request_id=rid,
        token_ids=cpb.TokenIds(ids=prompt),
        sampling=cpb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    return channel, cpb_grpc.TandemStub(channel).Generate(request, timeout=60)


@pytest.fixture(scope="module")
def slow(tiny_pair):
    """Steps slowed by 20 ms, so a cancel lands mid-decode."""
    cluster = start_cluster(tiny_pair, ["prefill", "decode"], env={"TANDEM_FAULTS": "engine.step=0.02"})
    yield cluster
    cluster.stop()


def test_client_cancel_mid_decode_frees_pages_everywhere(slow):
    channel, call = stream(slow.router_address, PROMPT, 200)
    chunks = 0
    for message in call:
        chunks += message.HasField("chunk")
        if chunks == 3:
            call.cancel()
            break
    channel.close()
    wait_no_request_holds_pages(slow)


def test_client_cancel_during_prefill_frees_pages_everywhere(slow):
    channel, call = stream(slow.router_address, list(range(1, 31)) * 10, 50)
    call.cancel()
    channel.close()
    wait_no_request_holds_pages(slow)
    tokens, _ = generate(slow.router_address, PROMPT, 4)
    assert len(tokens) == 4


def test_abort_mid_decode_completes_with_abort_and_only_from_its_client(slow):
    channel, call = stream(slow.router_address, PROMPT, 200, rid="to-abort")
    reasons = []

    def consume():
        for message in call:
            if message.HasField("complete"):
                reasons.append(message.complete.finish_reason)

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(0.5)
    abort = cpb.AbortRequest(request_id="to-abort")
    # another client (its own connection: channels of one process share theirs by default)
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(slow.router_address, options=own_connection) as other:
        foreign = cpb_grpc.TandemStub(other).Abort(abort, timeout=10).found
    found = cpb_grpc.TandemStub(channel).Abort(abort, timeout=10).found
    consumer.join(timeout=10)
    channel.close()
    assert (foreign, found) == (False, True)
    assert reasons == [cpb.FINISH_REASON_ABORT]
    wait_no_request_holds_pages(slow)


def test_an_expired_lease_frees_the_reservation(slow):
    decode = next(p for p in slow.processes if p.name.startswith("decode"))
    with grpc.insecure_channel(decode.grpc) as channel:
        stub = wpb_grpc.DecodeWorkerStub(channel)
        stub.Reserve(wpb.ReserveRequest(request_id="lease", prompt_len=40, lease_ms=300))
        used, cached = worker_pages(slow)[decode.name]["target"]
        assert used > cached
        wait_no_request_holds_pages(slow, timeout_s=3)
        released = stub.Release(wpb.ReleaseRequest(request_id="lease")).released
    assert not released  # the lease had already freed it
    text = urllib.request.urlopen(decode.metrics, timeout=5).read().decode()
    assert metric_sample(text, "tandem_timeouts_total", kind="lease") == 1.0


def test_a_renewed_lease_keeps_the_reservation_and_a_late_decode_is_told_why(slow):
    decode = next(p for p in slow.processes if p.name.startswith("decode"))
    with grpc.insecure_channel(decode.grpc) as channel:
        stub = wpb_grpc.DecodeWorkerStub(channel)
        stub.Reserve(wpb.ReserveRequest(request_id="renewed", prompt_len=40, lease_ms=600), timeout=5)
        for _ in range(3):  # 1.2 s in all, twice the lease
            time.sleep(0.4)
            stub.Renew(wpb.RenewRequest(request_id="renewed", lease_ms=600), timeout=5)
        kept = stub.Release(wpb.ReleaseRequest(request_id="renewed"), timeout=5).released
        stub.Reserve(wpb.ReserveRequest(request_id="lapsed", prompt_len=40, lease_ms=300), timeout=5)
        wait_no_request_holds_pages(slow, timeout_s=3)
        with pytest.raises(grpc.RpcError) as renew:
            stub.Renew(wpb.RenewRequest(request_id="lapsed"), timeout=5)
        decode_call = stub.Decode(
            wpb.DecodeRequest(request_id="lapsed", prompt_token_ids=list(range(1, 41))), timeout=5
        )
        with pytest.raises(grpc.RpcError) as late:
            list(decode_call)
    assert kept
    assert renew.value.code() == late.value.code() == grpc.StatusCode.NOT_FOUND
    assert late.value.details() == (
        "request_id: 'lapsed' is not reserved: its lease of 0.3 s ran out first (--lease-s)"
    )


def test_client_cancel_mid_transfer_frees_pages_everywhere(tiny_pair):
    cluster = start_cluster(tiny_pair, ["prefill", "decode"], env={"TANDEM_FAULTS": "prefill.before_send=2"})
    try:
        channel, call = stream(cluster.router_address, PROMPT, 20)
        consumer = threading.Thread(target=lambda: list(_ignore_cancel(call)))
        consumer.start()
        _wait_for_reservation(cluster)  # pages reserved on decode ...
        _wait_for_holder(cluster, "prefill")  # ... and held on prefill while the send waits
        call.cancel()
        consumer.join(timeout=10)
        channel.close()
        wait_no_request_holds_pages(cluster)
    finally:
        cluster.stop()


def _ignore_cancel(call):
    try:
        yield from call
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.CANCELLED


def test_sigkill_of_a_decode_worker_mid_transfer_is_retried_elsewhere(tiny_pair):
    cluster = start_cluster(
        tiny_pair, ["prefill", "decode", "decode"], env={"TANDEM_FAULTS": "prefill.before_send=3"}
    )
    try:
        result = {}
        worker = threading.Thread(
            target=lambda: result.update(out=generate(cluster.router_address, PROMPT, 6))
        )
        worker.start()
        holder = _wait_for_reservation(cluster)
        cluster.kill(holder)
        worker.join(timeout=30)
        tokens, complete = result["out"]
        assert len(tokens) == 6 and complete.finish_reason == cpb.FINISH_REASON_LENGTH
        survivors = [p for p in cluster.processes[1:] if p.name != holder]
        cluster.processes = [cluster.processes[0], *survivors]
        wait_no_request_holds_pages(cluster)
    finally:
        cluster.stop()


def test_sigkill_of_the_decode_worker_mid_decode_fails_unavailable(tiny_pair):
    cluster = start_cluster(tiny_pair, ["prefill", "decode"], env={"TANDEM_FAULTS": "engine.step=0.05"})
    try:
        channel, call = stream(cluster.router_address, PROMPT, 300)
        chunks, start = 0, None
        with pytest.raises(grpc.RpcError) as raised:
            for message in call:
                chunks += message.HasField("chunk")
                if chunks == 3 and start is None:
                    cluster.kill("decode-1")
                    start = time.monotonic()
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 5
        channel.close()
        cluster.processes = cluster.processes[:2]
        wait_no_request_holds_pages(cluster)
    finally:
        cluster.stop()


def test_a_restarted_decode_worker_registers_again_and_takes_traffic(tiny_pair):
    cluster = start_cluster(tiny_pair, ["prefill", "decode"])
    try:
        cluster.kill("decode-1")
        with pytest.raises(AssertionError):  # no pair: the request fails, naming why
            generate(cluster.router_address, PROMPT, 4)
        cluster.restart("decode-1")
        cluster.wait_serving()
        tokens, _ = generate(cluster.router_address, PROMPT, 4)
        assert len(tokens) == 4
        wait_no_request_holds_pages(cluster)
    finally:
        cluster.stop()


def _wait_for_reservation(cluster, timeout_s: float = 10) -> str:
    return _wait_for_holder(cluster, "decode", timeout_s)


def _wait_for_holder(cluster, role: str, timeout_s: float = 10) -> str:
    """The first worker of `role` on which a request holds target pages."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, groups in worker_pages(cluster).items():
            used, cached = groups["target"]
            if name.startswith(role) and used > cached:
                return name
        time.sleep(0.05)
    raise AssertionError(f"no {role} worker holds request pages")
