"""The fake transport keeps the Transport protocol's rules the agent relies on (the UCX
transport's own checks: test_ucx_local.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvcore.transfer import EndpointInfo, TransferError, TransferTimeout, TransportClosed
from tests.kvcore.transfer.fake_transport import FakeNetwork, FakeTransport


async def pair() -> tuple[FakeTransport, FakeTransport]:
    network = FakeNetwork()
    a, b = network.transport(), network.transport()
    for t in (a, b):
        await t.start()
    await a.connect("b", b.local_info())
    return a, b


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_messages_match_by_tag_whatever_their_order():
    async def body():
        a, b = await pair()
        sent = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
        await a.send("b", sent, 2)
        await a.send("b", b"first", 1)
        got = torch.empty_like(sent)
        first = await b.recv_message(1, 16, 1.0)
        await b.recv(got, 2, 1.0)
        return first, torch.equal(got, sent)

    assert run(body()) == (bytearray(b"first"), True)


def test_a_timed_out_receive_leaves_the_late_message_for_the_next():
    async def body():
        a, b = await pair()
        with pytest.raises(TransferTimeout):
            await b.recv(bytearray(4), 7, 0.05)
        await a.send("b", b"late", 7)
        got = bytearray(4)
        await b.recv(got, 7, 1.0)
        return bytes(got)

    assert run(body()) == b"late"


def test_refusals_name_what_is_wrong():
    async def body():
        a, b = await pair()
        await a.send("b", b"12345", 3)
        with pytest.raises(TransferError, match="message has 5 bytes, buffer has 4"):
            await b.recv(bytearray(4), 3, 1.0)
        with pytest.raises(ValueError, match="backend: 'ucx' is not this transport's 'fake'"):
            await a.connect("x", EndpointInfo("ucx", b"fake-1"))
        with pytest.raises(ValueError, match="peer_id: 'nobody' is not connected"):
            await a.send("nobody", b"x", 1)
        waiting = asyncio.ensure_future(b.recv(bytearray(1), 9, 5.0))
        await asyncio.sleep(0)
        await b.close()
        with pytest.raises(TransportClosed):
            await waiting

    run(body())
