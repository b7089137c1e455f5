"""One layer group's pages of one request, from one rank's pool to another's.

Per group and (sender rank, receiver rank), under tag group index ``index``:

    chunk 0          run header: [num_pages + 1] int32, 1 where a run starts, last = runs
    chunk 1..runs    one run of pages each

A whole-pool route (equal head sets) splits the pages into runs contiguous on both
sides (the receiver's ids come from its reservation) and moves each run straight from
pool to pool; without the receiver's ids it packs every page into one run. A head-sliced
route packs the route's heads of every page into one run, which the receiver unpacks
into its heads. Pools are ``[pages, layers, 2, heads, tokens_per_page, head_dim]``.
"""

from __future__ import annotations

import torch

from kvcore import TransferPages
from kvcore.ops import pack_pages, unpack_pages
from kvcore.transfer.head_routes import HeadRoute
from kvcore.transfer.tags import message_tag
from kvcore.transfer.ucx import TransferError, UcxTransport


async def send_group(
    transport: UcxTransport,
    pool: torch.Tensor,
    peer_id: str,
    tag: tuple[int, int],
    sent: TransferPages,
    route: HeadRoute,
    dest: list[int] | None,
    timeout_s: float,
) -> int:
    """Send ``sent`` along ``route``; ``tag`` is (request base tag, group index). Bytes sent."""
    base, index = tag
    sliced = not route.whole
    runs = [(0, len(sent.page_ids))] if sliced and sent.page_ids else common_runs(sent, dest)
    header = runs_header(runs, len(sent.page_ids))
    await transport.send(peer_id, header, message_tag(base, index, 0), timeout_s)
    moved = 0
    for chunk, (first, n) in enumerate(runs, start=1):
        ids = sent.page_ids[first : first + n]
        buffer = source_buffer(pool, ids, route.src_heads if sliced else None)
        await transport.send(peer_id, buffer, message_tag(base, index, chunk), timeout_s)
        moved += buffer.numel() * buffer.element_size()
    return moved


async def receive_group(
    transport: UcxTransport,
    pool: torch.Tensor,
    tag: tuple[int, int],
    landing: TransferPages,
    route: HeadRoute,
    timeout_s: float,
) -> int:
    """Receive what :func:`send_group` sends into ``landing``'s pages. Bytes received."""
    base, index = tag
    header = torch.zeros(len(landing.page_ids) + 1, dtype=torch.int32)
    await transport.recv(header, message_tag(base, index, 0), timeout_s)
    heads = None if route.whole else route.dst_heads
    moved = 0
    for chunk, (first, n) in enumerate(header_runs(header), start=1):
        ids = landing.page_ids[first : first + n]
        moved += await _receive_run(transport, pool, ids, message_tag(base, index, chunk), timeout_s, heads)
    return moved


def source_buffer(pool: torch.Tensor, ids: list[int], heads: slice | None) -> torch.Tensor:
    """Pages ``ids`` of ``pool`` (only ``heads`` when given): a view of the pool when they
    are whole and contiguous, else packed."""
    if heads is None and _contiguous(ids):
        return pool[ids[0] : ids[0] + len(ids)]
    return pack_pages(pool, torch.tensor(ids, dtype=torch.int64, device=pool.device), heads)


async def _receive_run(
    transport: UcxTransport, pool: torch.Tensor, ids: list[int], tag: int, timeout_s: float, heads
) -> int:
    """One run: straight into the pool when its pages are whole and contiguous here, else
    packed and scattered (into ``heads`` only, when given)."""
    n = len(ids)
    if heads is None and _contiguous(ids):
        await transport.recv(pool[ids[0] : ids[0] + n], tag, timeout_s)
        return n * pool[0].numel() * pool.element_size()
    shape = list(pool.shape)
    shape[0] = n
    if heads is not None:
        shape[3] = heads.stop - heads.start
    packed = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    await transport.recv(packed, tag, timeout_s)
    unpack_pages(pool, torch.tensor(ids, dtype=torch.int64, device=pool.device), packed, heads)
    return packed.numel() * packed.element_size()


def common_runs(pages: TransferPages, dest: list[int] | None) -> list[tuple[int, int]]:
    """Split the sent pages into runs contiguous on both sides: (first index, length).
    Without the receiver's ids (``dest``, its whole block-table row), one run of all."""
    src = pages.page_ids
    if not src:
        return []
    if dest is None:
        return [(0, len(src))]
    dst = dest[pages.first_page : pages.first_page + len(src)]
    if len(dst) != len(src) or any(p < 0 for p in dst):
        raise TransferError(f"dest: {len(dst)} receiver pages for {len(src)} sent pages")
    runs, start = [], 0
    for i in range(1, len(src) + 1):
        if i == len(src) or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    return runs


def runs_header(runs: list[tuple[int, int]], num_pages: int) -> torch.Tensor:
    """[num_pages + 1] int32: entry i is 1 where a run starts at page i; the last entry
    counts the runs."""
    header = torch.zeros(num_pages + 1, dtype=torch.int32)
    for first, _ in runs:
        header[first] = 1
    header[num_pages] = len(runs)
    return header


def header_runs(header: torch.Tensor) -> list[tuple[int, int]]:
    """Inverse of :func:`runs_header`: (first index, length) of every run."""
    starts = torch.nonzero(header[:-1]).flatten().tolist()
    ends = [*starts[1:], header.numel() - 1]
    if len(starts) != int(header[-1]):
        raise TransferError(f"run header: {len(starts)} starts, {int(header[-1])} runs announced")
    return [(a, b - a) for a, b in zip(starts, ends, strict=True)]


def _contiguous(ids: list[int]) -> bool:
    return ids == list(range(ids[0], ids[0] + len(ids)))
