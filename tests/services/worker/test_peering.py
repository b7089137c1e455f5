"""A worker's side of pairing refuses a peer of another transfer backend before its transport
does anything, naming both backends."""

from __future__ import annotations

import asyncio

from proto.tandem.v1 import registration_pb2 as reg
from services.common.metrics import Metrics
from services.worker.peering import PeerRegistry
from tests.services.common.peer_samples import prefill_and_decode


class UntouchedAgent:
    """An agent no refused pairing may reach."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the agent was asked for {name!r}")


def test_a_peer_of_another_backend_is_refused_and_not_connected():
    local, peer = prefill_and_decode()
    local.transfer_endpoint.backend, peer.transfer_endpoint.backend = "ucx", "nixl"
    peers = PeerRegistry(lambda: local, UntouchedAgent(), Metrics("prefill"))
    response = asyncio.run(peers.Register(reg.RegisterRequest(rank_info=peer, pairing_nonce="n"), None))
    assert not response.accepted
    assert [(m.field, m.local_value, m.peer_value) for m in response.mismatches] == [
        ("transfer_endpoint.backend", "'ucx'", "'nixl'")
    ]
    assert peers.peers == {}
    assert peers.metrics.registrations.labels("refused")._value.get() == 1
