"""One layer group's pages of one request, from one rank's pool to another's.

Per group and (sender rank, receiver rank), under tag group index ``index``:

    chunk 0          run header: [num_pages + 1] int32; at the page where a run starts,
                     the pages per message (>= 1), else 0; the last entry counts the runs
    chunk 1..        the messages: each run split into messages of that many pages
                     (the last of a run may hold fewer), runs in order

A whole-pool route (equal head sets) splits the pages into runs contiguous on both
sides (the receiver's ids come from its reservation) and moves each message straight from
pool to pool; without the receiver's ids, or when those runs are short (a pool whose free
queue has churned hands out scattered pages: runs of one 2 MiB page make UCX messages too
small to reach the link rate), it sends every page as one run, packed where a side's
pages of a message are not contiguous. A head-sliced
route packs the route's heads of every page into one run, which the receiver unpacks
into its heads. Pools are ``[pages, layers, 2, heads, tokens_per_page, head_dim]``.

**Message cap.** No message exceeds the sender's ``max_message_bytes``
(:data:`MAX_MESSAGE_BYTES` by default): pages per message = cap // bytes of one page on the
wire (the route's heads). The receiver follows the header, so only the sender needs the
cap. A page larger than the cap, or more messages than the tag's chunks hold
(``MAX_CHUNKS - 1``), is refused with a TransferError before anything is sent.

**Pipelining.** Where a message must be packed (a head slice, or pages not contiguous in
the sender's pool), the pack of message i+1 starts before the send of message i is awaited;
where one must be unpacked, the unpack of message i runs while message i+1 is received.
Copies run beside the event loop (:class:`~kvcore.transfer.staging.Stager`); at most two
staging buffers of one message each are alive per group, so memory stays bounded by twice
the cap. Messages that go pool to pool need no copy and no staging. The receiver probes each
message after the header for ``STREAM_SPIN_S`` before backing off: it is already on its way.
"""

from __future__ import annotations

import asyncio

import torch

from kvcore import TransferPages
from kvcore.ops import pack_pages, unpack_pages
from kvcore.transfer.errors import TransferError
from kvcore.transfer.head_routes import HeadRoute
from kvcore.transfer.staging import Stager, ready, settle
from kvcore.transfer.tags import MAX_CHUNKS, message_tag
from kvcore.transfer.transport import SPIN_S, STREAM_SPIN_S, Transport

MAX_MESSAGE_BYTES = 64 << 20
"""Default cap of one page message, bytes. Between two GPUs UCX (cuda_ipc) falls off a
throughput cliff for messages above 256 MiB; 64 MiB stays 4x below it and bounds a group's
staging memory (two messages) to 128 MiB. Larger messages amortize the per-message cost
better (on one GPU, 256 MiB moved 1.5-2x faster: docs/performance.md, 2026-12-02)."""

MIN_RUN_BYTES = 16 << 20
"""A whole-page transfer whose pool-to-pool runs average fewer bytes than this (or than the
cap, if lower) is sent as one packed run instead: a gather and a scatter on each side cost
less than many small messages."""

Run = tuple[int, int, int]  # (first index into the sent pages, pages, pages per message)


async def send_group(
    transport: Transport,
    pool: torch.Tensor,
    peer_id: str,
    tag: tuple[int, int],
    sent: TransferPages,
    route: HeadRoute,
    dest: list[int] | None,
    timeout_s: float,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> int:
    """Send ``sent`` along ``route``; ``tag`` is (request base tag, group index); no
    message above ``max_message_bytes``. Bytes sent."""
    base, index = tag
    heads = None if route.whole else route.src_heads
    ids = sent.page_ids
    page_bytes = wire_page_bytes(pool, heads)
    spans = [(0, len(ids))] if heads is not None and ids else common_runs(sent, dest)
    if len(spans) > 1 and len(ids) * page_bytes < len(spans) * min(MIN_RUN_BYTES, max_message_bytes):
        spans = [(0, len(ids))]  # short runs: one run, packed where a message's pages are scattered
    per = pages_per_message(page_bytes, max_message_bytes)
    runs = [(first, n, per) for first, n in spans]
    messages = split_runs(runs)
    await transport.send(peer_id, runs_header(runs, len(ids)), message_tag(base, index, 0), timeout_s)
    id_lists, tags = message_plan(ids, messages, tag)
    return await _send_messages(transport, pool, peer_id, id_lists, tags, heads, timeout_s)


async def receive_group(
    transport: Transport,
    pool: torch.Tensor,
    tag: tuple[int, int],
    landing: TransferPages,
    route: HeadRoute,
    timeout_s: float,
    header_spin_s: float = SPIN_S,
) -> int:
    """Receive what :func:`send_group` sends into ``landing``'s pages, split as its header
    says; the header is probed every loop turn for ``header_spin_s`` (see ``Transport.recv``).
    Bytes received."""
    base, index = tag
    header = torch.zeros(len(landing.page_ids) + 1, dtype=torch.int32)
    await transport.recv(header, message_tag(base, index, 0), timeout_s, header_spin_s)
    heads = None if route.whole else route.dst_heads
    id_lists, tags = message_plan(landing.page_ids, split_runs(header_runs(header)), tag)
    return await _receive_messages(transport, pool, id_lists, tags, heads, timeout_s)


def message_plan(
    ids: list[int], messages: list[tuple[int, int]], tag: tuple[int, int]
) -> tuple[list[list[int]], list[int]]:
    """Each message's page ids (of ``ids``) and its tag: chunks 1.., after the header's 0."""
    base, index = tag
    id_lists = [ids[first : first + n] for first, n in messages]
    return id_lists, [message_tag(base, index, chunk) for chunk in range(1, len(messages) + 1)]


async def _send_messages(
    transport: Transport,
    pool: torch.Tensor,
    peer_id: str,
    id_lists: list[list[int]],
    tags: list[int],
    heads: slice | None,
    timeout_s: float,
) -> int:
    """Send message i (pages ``id_lists[i]``) under ``tags[i]``, the source of message
    i+1 staged meanwhile: at most two staged buffers alive. Bytes sent."""
    stager, moved = Stager(pool.device), 0
    staged = _stage_source(stager, pool, id_lists[0], heads) if id_lists else None
    try:
        for i, tag in enumerate(tags):
            buffer = await staged
            nxt = i + 1
            staged = _stage_source(stager, pool, id_lists[nxt], heads) if nxt < len(id_lists) else None
            await transport.send(peer_id, buffer, tag, timeout_s)
            moved += buffer.numel() * buffer.element_size()
    finally:
        await settle(staged)
    return moved


async def _receive_messages(
    transport: Transport,
    pool: torch.Tensor,
    id_lists: list[list[int]],
    tags: list[int],
    heads: slice | None,
    timeout_s: float,
) -> int:
    """Receive message i into pages ``id_lists[i]``: straight into the pool when they are
    whole and contiguous here, else into a buffer unpacked while message i+1 arrives (one
    unpack in flight at a time). Returns once every page has landed. Bytes received."""
    stager, moved = Stager(pool.device), 0
    unpacking: asyncio.Future | None = None
    try:
        for ids, tag in zip(id_lists, tags, strict=True):
            if heads is None and _contiguous(ids):
                await transport.recv(pool[ids[0] : ids[0] + len(ids)], tag, timeout_s, STREAM_SPIN_S)
                moved += len(ids) * pool[0].numel() * pool.element_size()
                continue
            packed = _landing_buffer(pool, len(ids), heads)
            await transport.recv(packed, tag, timeout_s, STREAM_SPIN_S)
            if unpacking is not None:
                await unpacking
            unpacking = stager.start(lambda ids=ids, packed=packed: _unpack(pool, ids, packed, heads))
            moved += packed.numel() * packed.element_size()
        if unpacking is not None:
            pending, unpacking = unpacking, None
            await pending
    finally:
        await settle(unpacking)
    return moved


def source_buffer(pool: torch.Tensor, ids: list[int], heads: slice | None) -> torch.Tensor:
    """Pages ``ids`` of ``pool`` (only ``heads`` when given): a view of the pool when they
    are whole and contiguous, else packed."""
    if heads is None and _contiguous(ids):
        return pool[ids[0] : ids[0] + len(ids)]
    return pack_pages(pool, torch.tensor(ids, dtype=torch.int64, device=pool.device), heads)


def _stage_source(stager: Stager, pool: torch.Tensor, ids: list[int], heads: slice | None) -> asyncio.Future:
    """The future of message ``ids``'s source buffer: ready at once for a pool view, else
    its pack started."""
    if heads is None and _contiguous(ids):
        return ready(source_buffer(pool, ids, None))
    return stager.start(lambda: source_buffer(pool, ids, heads))


def _landing_buffer(pool: torch.Tensor, n: int, heads: slice | None) -> torch.Tensor:
    """An empty packed buffer of ``n`` pages (only ``heads`` when given)."""
    shape = list(pool.shape)
    shape[0] = n
    if heads is not None:
        shape[3] = heads.stop - heads.start
    return torch.empty(shape, dtype=pool.dtype, device=pool.device)


def _unpack(pool: torch.Tensor, ids: list[int], packed: torch.Tensor, heads: slice | None) -> torch.Tensor:
    """Scatter ``packed`` into pages ``ids``; returns ``packed``, so the buffer lives until
    the copy is done."""
    unpack_pages(pool, torch.tensor(ids, dtype=torch.int64, device=pool.device), packed, heads)
    return packed


def wire_page_bytes(pool: torch.Tensor, heads: slice | None) -> int:
    """Bytes of one page as it travels: the whole page, or only ``heads`` of it."""
    page = pool[0].numel() * pool.element_size()
    return page if heads is None else page // pool.shape[3] * (heads.stop - heads.start)


def pages_per_message(page_bytes: int, max_message_bytes: int) -> int:
    """Whole pages of ``page_bytes`` that fit a message of ``max_message_bytes`` (>= 1);
    TransferError when not even one does."""
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes: must be > 0, got {max_message_bytes}")
    if page_bytes > max_message_bytes:
        raise TransferError(
            f"max_message_bytes: {max_message_bytes} is below one page's {page_bytes} bytes; raise the cap"
        )
    return max_message_bytes // max(page_bytes, 1)


def split_runs(runs: list[Run]) -> list[tuple[int, int]]:
    """Every message of ``runs``, in chunk order: (first index, pages). TransferError when
    they need more chunks than a tag holds (chunk 0 is the header)."""
    messages = [(first + k, min(per, n - k)) for first, n, per in runs for k in range(0, n, max(per, 1))]
    if len(messages) > MAX_CHUNKS - 1:
        raise TransferError(
            f"{len(messages)} messages in one group exceed the tag's {MAX_CHUNKS - 1} chunks; "
            "raise max_message_bytes"
        )
    return messages


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


def runs_header(runs: list[Run], num_pages: int) -> torch.Tensor:
    """[num_pages + 1] int32: entry i is the run's pages per message (>= 1) where a run
    starts at page i, else 0; the last entry counts the runs."""
    header = torch.zeros(num_pages + 1, dtype=torch.int32)
    for first, _, per in runs:
        if per < 1:
            raise ValueError(f"runs: pages per message must be >= 1, got {per}")
        header[first] = per
    header[num_pages] = len(runs)
    return header


def header_runs(header: torch.Tensor) -> list[Run]:
    """Inverse of :func:`runs_header`: (first index, length, pages per message) of every run."""
    starts = torch.nonzero(header[:-1]).flatten().tolist()
    ends = [*starts[1:], header.numel() - 1]
    if len(starts) != int(header[-1]):
        raise TransferError(f"run header: {len(starts)} starts, {int(header[-1])} runs announced")
    pers = header[starts].tolist() if starts else []
    if any(per < 1 for per in pers):
        raise TransferError(f"run header: pages per message must be >= 1, got {min(pers)}")
    return [(a, b - a, per) for a, b, per in zip(starts, ends, pers, strict=True)]


def _contiguous(ids: list[int]) -> bool:
    return ids == list(range(ids[0], ids[0] + len(ids)))
