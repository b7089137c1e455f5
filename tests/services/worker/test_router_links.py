"""Which routers a worker registers with: every address of every name in ``--router``."""

from __future__ import annotations

import asyncio

from services.worker.router_links import router_addresses


def test_addresses_are_listed_once_each_names_resolved_literals_kept():
    spec = "127.0.0.1:50051, [::1]:50053,127.0.0.1:50051"
    assert asyncio.run(router_addresses(spec)) == ["127.0.0.1:50051", "[::1]:50053"]
    resolved = asyncio.run(router_addresses("localhost:50052"))
    assert "127.0.0.1:50052" in resolved and "localhost:50052" not in resolved
