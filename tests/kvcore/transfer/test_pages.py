"""Page messages in one process, over a fake transport: the split under the message cap,
its header, the limits it refuses, and the pipeline (the next pack starts while the
current message is still being sent)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvcore import TransferPages
from kvcore.transfer import pages
from kvcore.transfer.head_routes import HeadRoute
from kvcore.transfer.pages import (
    header_runs,
    pages_per_message,
    receive_group,
    runs_header,
    send_group,
    split_runs,
)
from kvcore.transfer.tags import MAX_CHUNKS, request_tag, split_tag
from kvcore.transfer.ucx import TransferError

SLICE = HeadRoute(0, 0, slice(1, 2), slice(0, 1), False)
WHOLE = HeadRoute(0, 0, slice(0, 2), slice(0, 2), True)


class FakeTransport:
    """Messages kept by tag; each send takes a few ms, logged at its start and end."""

    def __init__(self) -> None:
        self.messages: dict[int, torch.Tensor] = {}
        self.log: list[tuple[str, int]] = []

    async def send(self, peer_id: str, buffer: torch.Tensor, tag: int, timeout_s=None) -> None:
        chunk = split_tag(tag)[2]
        self.log.append(("send", chunk))
        await asyncio.sleep(0.02)
        self.messages[tag] = buffer.contiguous().view(torch.uint8).reshape(-1).clone()
        self.log.append(("sent", chunk))

    async def recv(self, buffer: torch.Tensor, tag: int, timeout_s: float, spin_s: float = 0.0) -> None:
        data = self.messages.pop(tag)
        flat = buffer.view(torch.uint8).reshape(-1)
        assert flat.numel() == data.numel()
        flat.copy_(data)


def pool(seed: int | None) -> torch.Tensor:
    """[16 pages, 2 layers, K/V, 2 heads, 4 tokens, dim 4] float32: 512 B a page."""
    if seed is None:
        return torch.zeros(16, 2, 2, 2, 4, 4)
    return torch.randn(16, 2, 2, 2, 4, 4, generator=torch.Generator().manual_seed(seed))


def test_header_round_trips_runs_and_their_split():
    runs = [(0, 5, 2), (5, 1, 2), (6, 4, 3)]
    header = runs_header(runs, 10)
    assert header_runs(header) == runs
    assert split_runs(runs) == [(0, 2), (2, 2), (4, 1), (5, 1), (6, 3), (9, 1)]


def test_pages_per_message_refuses_a_page_above_the_cap():
    assert pages_per_message(512, 1024) == 2
    assert pages_per_message(512, 1535) == 2
    with pytest.raises(TransferError, match="below one page"):
        pages_per_message(513, 512)
    with pytest.raises(ValueError, match="max_message_bytes"):
        pages_per_message(512, 0)


def test_split_refuses_more_messages_than_the_tag_has_chunks():
    assert len(split_runs([(0, MAX_CHUNKS - 1, 1)])) == MAX_CHUNKS - 1
    with pytest.raises(TransferError, match="chunks"):
        split_runs([(0, MAX_CHUNKS, 1)])


def test_a_refused_split_sends_nothing():
    transport = FakeTransport()
    sent = TransferPages(0, list(range(4)))
    with pytest.raises(TransferError, match="below one page"):
        asyncio.run(
            send_group(transport, pool(1), "peer", (request_tag("r"), 0), sent, WHOLE, None, 5.0, 256)
        )
    assert transport.messages == {}


@pytest.mark.parametrize("route", [WHOLE, SLICE], ids=["whole", "sliced"])
def test_packed_messages_are_pipelined_and_land_bit_exact(monkeypatch, route):
    """Non-contiguous pages on both sides, so every message is packed and unpacked."""
    packs: list[tuple[str, int]] = []
    transport = FakeTransport()
    real_pack = pages.pack_pages

    def logged_pack(kv_pool, page_ids, heads=None):
        packs.append(("pack", len(packs) + 1))
        transport.log.append(packs[-1])
        return real_pack(kv_pool, page_ids, heads)

    monkeypatch.setattr(pages, "pack_pages", logged_pack)
    src, dst = pool(1), pool(None)
    sent, landing = TransferPages(0, [1, 3, 5, 7, 9, 11]), TransferPages(0, [14, 12, 10, 8, 6, 4])
    tag = (request_tag("r"), 0)

    async def both() -> tuple[int, int]:
        moved = await send_group(transport, src, "peer", tag, sent, route, None, 5.0, 1024)
        return moved, await receive_group(transport, dst, tag, landing, route, 5.0)

    moved, landed = asyncio.run(both())
    heads = slice(None) if route.whole else route.src_heads
    messages = len(packs)
    assert messages == (3 if route.whole else 2)  # 2 whole pages or 4 head slices a message
    assert moved == landed == 6 * (512 if route.whole else 256)
    dst_heads = slice(None) if route.whole else route.dst_heads
    assert torch.equal(dst[landing.page_ids][:, :, :, dst_heads], src[sent.page_ids][:, :, :, heads])
    others = [p for p in range(16) if p not in landing.page_ids]
    assert not dst[others].any()
    if not route.whole:
        assert not dst[landing.page_ids][:, :, :, 1:].any()
    log = transport.log
    for i in range(1, messages):  # pack i + 1 starts before send i is done
        assert log.index(("pack", i + 1)) < log.index(("sent", i)), log


def test_short_pool_to_pool_runs_become_one_packed_run():
    """Scattered receiver pages: runs of one page, below the cap, so the sender packs them
    into messages of the cap (2 pages) and the receiver unpacks; long runs stay pool to pool."""
    transport, src, dst = FakeTransport(), pool(2), pool(None)
    sent, dest = TransferPages(0, [0, 1, 2, 3]), [9, 7, 5, 3]
    tag = (request_tag("r"), 0)

    async def both() -> int:
        await send_group(transport, src, "peer", tag, sent, WHOLE, dest, 5.0, 1024)
        header = next(m for t, m in transport.messages.items() if split_tag(t)[2] == 0)
        assert header.view(torch.int32).tolist() == [2, 0, 0, 0, 1]  # one run, 2 pages a message
        return await receive_group(transport, dst, tag, TransferPages(0, dest), WHOLE, 5.0)

    assert asyncio.run(both()) == 4 * 512
    assert torch.equal(dst[dest], src[sent.page_ids])
    assert pages.common_runs(sent, [4, 5, 6, 7]) == [(0, 4)]  # contiguous: one pool-to-pool run
