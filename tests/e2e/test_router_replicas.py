"""Two router replicas over one pair of workers: every worker registers with both, each
router pairs them, and when one router dies the other keeps serving (a client retries on it)."""

from __future__ import annotations

import grpc
import pytest

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from tests.e2e.conftest import generate, start_cluster
from tests.e2e.test_faults import wait_no_request_holds_pages

pytestmark = pytest.mark.slow
PROMPT = list(range(1, 30))


@pytest.fixture(scope="module")
def replicas(tiny_pair):
    cluster = start_cluster(tiny_pair, ["prefill", "decode"], routers=2)
    yield cluster
    cluster.stop()


def _health(address: str) -> cpb.HealthResponse:
    with grpc.insecure_channel(address) as channel:
        return cpb_grpc.TandemStub(channel).Health(cpb.HealthRequest(), timeout=5)


def generate_anywhere(addresses: list[str], prompt: list[int]) -> tuple[str, list[int]]:
    """A client that knows every router: the first that answers serves the request."""
    for address in addresses:
        try:
            tokens, _ = generate(address, prompt, 16, temperature=0)
            return address, tokens
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
    raise AssertionError("no router answered")


def test_both_routers_pair_the_workers_and_serve_the_same_tokens(replicas):
    first, second = (p.grpc for p in replicas.processes[:2])
    assert [(_health(a).num_ready_pairs, _health(a).status) for a in (first, second)] == [
        (1, cpb.SERVING_STATUS_SERVING)
    ] * 2
    a, _ = generate(first, PROMPT, 16, temperature=0)
    b, _ = generate(second, PROMPT, 16, temperature=0)
    assert a == b and len(a) == 16
    wait_no_request_holds_pages(replicas)


def test_one_router_killed_the_other_keeps_serving(replicas):
    addresses = [p.grpc for p in replicas.processes[:2]]
    expected, _ = generate(addresses[1], PROMPT, 16, temperature=0)
    replicas.kill("router")
    served_by, tokens = generate_anywhere(addresses, PROMPT)
    assert (served_by, tokens) == (addresses[1], expected)
    wait_no_request_holds_pages(replicas)
