"""The transport's contract, checked in one process: it connects to itself.

UCX keeps one worker per process, shared by these tests, so each test uses tags
of its own (a message left queued by one test can never reach another).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvcore.transfer.tags import make_tag
from kvcore.transfer.ucx import (
    EndpointInfo,
    TransferError,
    TransferTimeout,
    TransportClosed,
    UcxPath,
    UcxTransport,
)


async def started(**kwargs) -> UcxTransport:
    transport = UcxTransport(**kwargs)
    await transport.start()
    await transport.connect("self", transport.local_info())
    return transport


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_round_trip_is_bit_exact():
    async def body():
        transport = await started()
        sent = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).view(torch.bfloat16)
        got = torch.empty_like(sent)
        tag = make_tag("local-round-trip", 1, 7)
        await asyncio.gather(transport.send("self", sent, tag, 5), transport.recv(got, tag, 5))
        await transport.close()
        return torch.equal(sent.view(torch.uint8), got.view(torch.uint8))

    assert run(body())


def test_timed_out_receive_leaves_nothing_posted():
    """After a timeout, a late message is neither lost nor written into the old buffer."""

    async def body():
        transport = await started()
        tag = make_tag("local-late", 0, 0)
        stale = torch.zeros(64, dtype=torch.uint8)
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            await transport.recv(stale, tag, 0.2)
        waited_s = time.monotonic() - start
        await transport.send("self", torch.full((64,), 7, dtype=torch.uint8), tag, 5)
        fresh = torch.zeros(64, dtype=torch.uint8)
        await transport.recv(fresh, tag, 5)
        await transport.close()
        return waited_s, stale, fresh

    waited_s, stale, fresh = run(body())
    assert waited_s >= 0.2
    assert stale.tolist() == [0] * 64
    assert fresh.tolist() == [7] * 64


def test_size_mismatch_is_refused_and_drained():
    async def body():
        transport = await started()
        tag = make_tag("local-size", 0, 0)
        await transport.send("self", torch.ones(12, dtype=torch.uint8), tag, 5)
        with pytest.raises(TransferError, match="12 bytes, buffer has 10"):
            await transport.recv(torch.empty(10, dtype=torch.uint8), tag, 5)
        with pytest.raises(TransferTimeout):  # the bad message did not stay queued
            await transport.recv(torch.empty(12, dtype=torch.uint8), tag, 0.1)
        await transport.close()

    run(body())


def test_a_send_nobody_receives_times_out_keeps_the_endpoint_and_lands_once_received():
    """A timed-out send is left to finish on the same endpoint: the link keeps working, and
    the message lands once a receive takes it (closing the endpoint instead waited for the
    peer, and broke the peer's rendezvous replies). A forgotten peer is not sent to."""

    async def body():
        transport = await started()
        big = torch.arange(16 << 20, dtype=torch.int32).to(torch.uint8)  # rendezvous: waits for the receiver
        late = make_tag("local-unreceived", 0, 0)
        with pytest.raises(TransferTimeout, match="not taken within 0.2 s"):
            await transport.send("self", big, late, 0.2)
        kept = (transport.is_connected("self"), transport.is_known("self"))
        tag, got = make_tag("local-after-timeout", 0, 0), bytearray(5)
        await asyncio.gather(transport.send("self", b"again", tag, 5), transport.recv(got, tag, 5))
        landed = torch.empty_like(big)
        await transport.recv(landed, late, 5)
        await transport.connect("self", transport.local_info())  # the same address: kept
        await transport.disconnect("self")
        with pytest.raises(ValueError, match="not connected"):
            await transport.send("self", b"x", tag, 1)
        await transport.close()
        return kept, bytes(got), torch.equal(landed, big)

    assert run(body()) == ((True, True), b"again", True)


def test_close_wakes_a_waiting_receive_and_refuses_later_calls():
    async def body():
        transport = await started()
        waiting = asyncio.ensure_future(
            transport.recv(torch.empty(8, dtype=torch.uint8), make_tag("local-close", 0, 0), 10)
        )
        await asyncio.sleep(0.05)
        await transport.close()
        await transport.close()  # idempotent
        with pytest.raises(TransportClosed):
            await waiting
        with pytest.raises(TransportClosed):
            await transport.send("self", b"x", 1)
        with pytest.raises(TransportClosed):
            transport.local_info()
        with pytest.raises(TransportClosed):
            await transport.start()

    run(body())


def test_calls_before_start_are_refused():
    async def body():
        transport = UcxTransport()
        with pytest.raises(TransportClosed, match="not started"):
            transport.local_info()
        with pytest.raises(TransportClosed, match="not started"):
            await transport.recv(bytearray(4), 1, 1.0)

    run(body())


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="port"):
        UcxTransport(port=70000)

    async def body():
        transport = await started()
        info = transport.local_info()
        cases = [
            (transport.connect("", info), "peer_id"),
            (transport.connect("x", EndpointInfo("ucx", b"")), "worker_address"),
            (transport.connect("x", EndpointInfo("ucx", b"", "", 0), UcxPath.LISTENER), "host"),
            (transport.connect("x", EndpointInfo("ucx", b"", "127.0.0.1", 0), UcxPath.LISTENER), "port"),
            (transport.connect("x", EndpointInfo("nixl", info.address)), "backend: 'nixl' .* 'ucx'"),
            (transport.send("nobody", b"x", 1), "peer_id"),
            (transport.send("self", b"x", -1), "tag"),
            (transport.send("self", b"x", 1 << 64), "tag"),
            (transport.send("self", torch.zeros(4, 4).t(), 1), "buffer"),
            (transport.recv(bytearray(4), 1, 0), "timeout_s"),
            (transport.recv(b"read-only", 1, 1.0), "buffer"),
        ]
        for coro, field in cases:
            with pytest.raises(ValueError, match=field):
                await coro
        await transport.close()

    run(body())


def test_listener_path_in_one_process():
    async def body():
        transport = await started(listen=True)
        info = transport.local_info()
        assert info.host == "127.0.0.1" and info.port > 0
        await transport.connect("tcp", info, UcxPath.LISTENER)
        sent = torch.arange(1 << 16, dtype=torch.int32)
        got = torch.empty_like(sent)
        tag = make_tag("local-tcp", 0, 0)
        await asyncio.gather(transport.send("tcp", sent, tag, 5), transport.recv(got, tag, 5))
        await transport.close()
        return torch.equal(sent, got)

    assert run(body())


def test_an_idle_worker_sleeps_after_a_message(monkeypatch):
    """ucxx's blocking mode armed the worker only once: after a message its epoll reader ran
    on every loop turn (a core spent idle). The worker is now armed again after each event,
    so an idle loop does not run the reader."""
    from ucxx._lib_async.continuous_ucx_progress import BlockingMode

    calls = []
    reader = BlockingMode._fd_reader_callback
    monkeypatch.setattr(BlockingMode, "_fd_reader_callback", lambda self: (calls.append(1), reader(self))[1])

    async def body():
        transport = await started()  # this loop's progress task binds the counting reader
        tag = make_tag("local-idle", 0, 0)
        got = torch.empty(1 << 20, dtype=torch.uint8)
        for _ in range(3):
            await asyncio.gather(
                transport.send("self", torch.ones_like(got), tag, 5), transport.recv(got, tag, 5)
            )
        await asyncio.sleep(0.1)  # the arm task finishes
        calls.clear()
        await asyncio.sleep(0.5)
        await transport.close()
        return len(calls), int(got.sum())

    idle_calls, total = run(body())
    assert total == 1 << 20
    assert idle_calls <= 2


class _CountingWorker:
    def __init__(self, worker):
        self.worker, self.calls = worker, 0

    def progress(self):
        self.calls += 1
        return self.worker.progress()

    def __getattr__(self, name):
        return getattr(self.worker, name)


class _Context:
    """The transport's ucxx context with its worker's progress calls counted."""

    def __init__(self, context):
        self._context, self.worker = context, _CountingWorker(context.worker)

    def __getattr__(self, name):
        return getattr(self._context, name)


def test_overlapping_transfers_progress_the_worker_once_a_loop_turn():
    async def body():
        transport = await started()
        context = transport._context = _Context(transport._context)
        turns = [0]
        done = asyncio.Event()

        async def count_turns():
            while not done.is_set():
                turns[0] += 1
                await asyncio.sleep(0)

        async def round_trip(i):
            sent = torch.full((1 << 20,), i, dtype=torch.uint8)
            got = torch.empty_like(sent)
            tag = make_tag("local-once-a-turn", i, 1)
            await asyncio.gather(transport.send("self", sent, tag, 5), transport.recv(got, tag, 5))
            return torch.equal(sent, got)

        counter = asyncio.create_task(count_turns())
        try:
            landed = await asyncio.gather(*(round_trip(i) for i in range(6)))
        finally:
            done.set()
            await counter
            transport._context = context._context
            await transport.close()
        return landed, context.worker.calls, turns[0]

    landed, calls, turns = run(body())
    assert all(landed)
    assert 0 < calls <= turns + 1  # twelve waiters, one progress a turn
