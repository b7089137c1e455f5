"""Random requests at a live cluster: every one completes or is refused with a status that
names the field; none gets UNKNOWN or INTERNAL, and the cluster keeps serving."""

from __future__ import annotations

import re

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from tests.e2e.conftest import generate, start_cluster
from tests.e2e.test_faults import wait_no_request_holds_pages

pytestmark = pytest.mark.slow
FIELD = re.compile(r"^[a-z_]+(\.[a-z_]+|\[\d+\])*: ")
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))

floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.5, 1.0, -1.0])
)
sampling = st.builds(
    cpb.SamplingParams,
    max_tokens=st.integers(0, 2**32 - 1) | st.integers(0, 8),
    temperature=floats,
    top_p=floats,
    seed=st.integers(0, 2**64 - 1),
    stop=st.lists(st.text(max_size=3), max_size=2),
    ignore_eos=st.booleans(),
)
prompts = st.one_of(
    st.text(max_size=40).map(lambda t: {"text": t}),
    st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 31), max_size=40).map(
        lambda ids: {"token_ids": cpb.TokenIds(ids=ids)}
    ),
    st.just({}),
)


@pytest.fixture(scope="module")
def cluster(tiny_pair):
    cluster = start_cluster(tiny_pair, ["prefill", "decode"])
    yield cluster
    cluster.stop()


def assert_named_refusal(error: grpc.RpcError) -> None:
    assert error.code() in REFUSALS, (error.code(), error.details())
    assert FIELD.match(error.details()), error.details()


@FUZZ
@given(prompt=prompts, params=sampling, rid=st.text(max_size=3))
def test_random_generate_requests(cluster, prompt, params, rid):
    request = cpb.GenerateRequest(request_id=rid, sampling=params, **prompt)
    with grpc.insecure_channel(cluster.router_address) as channel:
        try:
            messages = list(cpb_grpc.TandemStub(channel).Generate(request, timeout=30))
        except grpc.RpcError as e:
            assert_named_refusal(e)
            return
    assert messages[-1].HasField("complete")


@FUZZ
@given(
    rid=st.text(max_size=4),
    n=st.integers(0, 5000),
    lease=st.integers(0, 2000),
    ids=st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 31), max_size=6),
)
def test_random_decode_worker_calls(cluster, rid, n, lease, ids):
    decode = cluster.processes[2]
    with grpc.insecure_channel(decode.grpc) as channel:
        stub = wpb_grpc.DecodeWorkerStub(channel)
        try:
            stub.Reserve(
                wpb.ReserveRequest(request_id=rid, prompt_len=n, lease_ms=lease, prompt_token_ids=ids),
                timeout=10,
            )
        except grpc.RpcError as e:
            assert_named_refusal(e)
        try:
            list(stub.Decode(wpb.DecodeRequest(request_id=rid, prompt_token_ids=[1] * (n % 7)), timeout=2))
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                assert_named_refusal(e)  # else: reserved pages that nobody fills
        try:
            stub.Release(wpb.ReleaseRequest(request_id=rid), timeout=10)
        except grpc.RpcError as e:
            assert_named_refusal(e)


@FUZZ
@given(
    rid=st.text(max_size=4),
    ids=st.lists(st.integers(0, 300), max_size=10),
    decode_id=st.sampled_from(["", "nobody", "decode-1"]),
    groups=st.lists(
        st.builds(
            wpb.GroupPages,
            group=st.sampled_from(["target", "draft", "x"]),
            page_ids=st.lists(st.integers(-2, 3), max_size=3),
            num_held=st.integers(0, 4),
        ),
        max_size=2,
    ),
)
def test_random_prefill_worker_calls(cluster, rid, ids, decode_id, groups):
    prefill = cluster.processes[1]
    request = wpb.PrefillRequest(
        request_id=rid,
        prompt_token_ids=ids,
        reservation=wpb.Reservation(decode_instance_id=decode_id, groups=groups),
    )
    with grpc.insecure_channel(prefill.grpc) as channel:
        try:
            # a well-formed one for decode-1 prefills, then waits for an acknowledgement that
            # never comes (nothing was reserved there): the deadline ends it
            list(wpb_grpc.PrefillWorkerStub(channel).Prefill(request, timeout=3))
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                assert_named_refusal(e)


def test_the_cluster_still_serves_and_holds_no_pages(cluster):
    tokens, _ = generate(cluster.router_address, list(range(1, 20)), 5)
    assert len(tokens) == 5
    wait_no_request_holds_pages(cluster, timeout_s=5)
