"""A reservation becomes a TransferTarget once checked, naming the first bad field; an agent
refuses a target on another backend; the backend registry refuses a name it does not know."""

from __future__ import annotations

import pytest

from kvcore import KVCacheManager, KVPools
from kvcore.transfer import EndpointInfo, TransferAgent, TransferTarget, new_transport
from kvcore.transfer.tags import request_tag
from kvcore.transfer.ucx import UcxTransport
from tests.kvcore.transfer.fake_transport import FakeNetwork
from tests.kvcore.transfer.sessions import tp_config

ROWS = [("target", [4, 5, 6], 1), ("draft", [-1, 7], 0)]
LOW_SET = request_tag("r") | 5  # a chunk bit set


def fake_agent() -> TransferAgent:
    pools = KVPools.allocate(tp_config(1))
    return TransferAgent(KVCacheManager(tp_config(1), pools), pools, 0, FakeNetwork().transport())


def test_a_reservation_becomes_a_target_group_by_group():
    tag, endpoint = request_tag("r"), EndpointInfo("fake", b"d0")
    target = TransferTarget.of("d0", ROWS, tag, endpoint)
    dest, held = {"target": [4, 5, 6], "draft": [-1, 7]}, {"target": 1, "draft": 0}
    assert target == TransferTarget("d0", dest, held, tag, endpoint)


@pytest.mark.parametrize(
    ("peer_id", "rows", "tag", "refusal"),
    [
        ("", ROWS, 0, "peer_id: empty"),
        ("d0", [ROWS[0], ("draft", [-1, 7], 3)], 0, "groups[1].num_held: 3 of 2 pages"),
        ("d0", ROWS, LOW_SET, f"transfer_tag: {LOW_SET:#x} has its low 24 bits set"),
    ],
)
def test_a_bad_reservation_is_refused_naming_the_field(peer_id, rows, tag, refusal):
    with pytest.raises(ValueError) as refused:
        TransferTarget.of(peer_id, rows, tag)
    assert str(refused.value) == refusal


def test_an_agent_refuses_a_target_on_another_backend():
    agent = fake_agent()
    agent.check_target(TransferTarget.of("d0", ROWS))  # no endpoint named: the pair's
    agent.check_target(TransferTarget.of("d0", ROWS, endpoint=EndpointInfo("fake", b"d0")))
    with pytest.raises(ValueError) as refused:
        agent.check_target(TransferTarget.of("d0", ROWS, endpoint=EndpointInfo("ucx", b"d0")))
    assert str(refused.value) == "endpoint.backend: 'ucx', but this worker's transport is 'fake'"


def test_the_registry_makes_the_default_backend_and_refuses_an_unknown_one():
    assert isinstance(new_transport(), UcxTransport) and new_transport().backend == "ucx"
    with pytest.raises(ValueError, match=r"backend: 'nixl' is not a transfer backend \(known: \['ucx'\]\)"):
        new_transport("nixl")
