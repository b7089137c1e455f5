"""One graphed forward shape: a model over ``q_len`` tokens per sequence, per batch bucket.

Each bucket (1, 2, 4, 8, 16, 32, 64, ...) is captured once, largest first, all into one
memory pool, and later replayed over static input buffers:

- b requests run in the smallest bucket >= b. Rows b .. bucket - 1 are padding: their
  KV slots are -1 (the KV write skips them) and their seq_len is 0 (attention reads no
  key and outputs zeros), so they touch no page;
- attention goes through ``decode_attention`` / ``verify_attention``, whose query length
  is a Python int: nothing in the forward reads a device value back, so it captures;
- the inputs live in two device buffers (int64: ids | positions | slots; int32:
  seq_lens | block table), each refilled by one copy from pinned host staging;
- outputs are copied into buffers allocated before any capture, outside the graph pool,
  so no graph's scratch memory aliases them; callers get copies.

Without CUDA (``capture=False``) the same static-buffer path runs the forward directly:
that is how the CPU tests check the padding rules.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvcore.ops import decode_attention, uniform_slots, verify_attention
from kvcore.spec import NULL_PAGE
from services.engine.batch import Span
from services.engine.models.attention import WritesPages

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# (input_ids [n], positions [n], hidden [n, hidden_size] or None, ctx) -> outputs [n, ...]
ForwardFn = Callable[
    [torch.Tensor, torch.Tensor, "torch.Tensor | None", "UniformContext"], tuple[torch.Tensor, ...]
]


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The standard buckets up to the first that holds ``max_batch``: 12 -> (1, 2, 4, 8, 16).
    Past the largest standard bucket, batches run eagerly."""
    if max_batch < 1:
        raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
    smaller = [b for b in BATCH_BUCKETS if b < max_batch]
    return (*smaller, next((b for b in BATCH_BUCKETS if b >= max_batch), BATCH_BUCKETS[-1]))


@dataclass(slots=True)
class UniformContext(WritesPages):
    """KV context of a batch whose sequences all have ``q_len`` query tokens, the last
    ``q_len`` positions of their ``seq_lens``. Padding rows: seq_len 0, slots -1."""

    kv_pool: torch.Tensor  # [num_pages, num_layers, 2, num_kv_heads, tokens_per_page, head_dim]
    block_table: torch.Tensor  # [batch, max_pages] int32, NULL_PAGE padded
    seq_lens: torch.Tensor  # [batch] int32
    slot_mapping: torch.Tensor  # [batch * q_len] int64, -1 = do not write
    q_len: int
    window: int = 0
    key_start: int = 0

    def _attend_written(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        args = (self.kv_pool, layer, self.block_table, self.seq_lens, scale, self.window, self.key_start)
        if self.q_len == 1:
            return decode_attention(q, *args)
        out = verify_attention(q.view(-1, self.q_len, *q.shape[1:]), *args)
        return out.view(q.shape)


@dataclass(slots=True)
class UniformBatch:
    """One forward's inputs on the host: ``batch`` sequences of ``q_len`` tokens each."""

    input_ids: torch.Tensor  # [batch * q_len] int64
    positions: torch.Tensor  # [batch * q_len] int64
    slot_mapping: torch.Tensor  # [batch * q_len] int64, -1 = do not write
    block_table: torch.Tensor  # [batch, width] int32, NULL_PAGE padded
    seq_lens: torch.Tensor  # [batch] int32
    hidden: torch.Tensor | None = None  # [batch * q_len, hidden_size] on the device, or None

    @property
    def batch(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def uniform_batch(
    spans: Sequence[Span], block_table: torch.Tensor, tokens_per_page: int, hidden: torch.Tensor | None = None
) -> UniformBatch:
    """Host-side inputs of spans that all have the same length; ``block_table`` [batch,
    width] is their rows. KV is written only at positions >= each span's write_start."""
    q_len, batch = len(spans[0].token_ids), len(spans)
    starts = np.fromiter((s.start for s in spans), np.int64, batch)
    write_start = np.fromiter((s.write_start for s in spans), np.int64, batch)
    positions = starts[:, None] + np.arange(q_len)  # [batch, q_len]
    slots = uniform_slots(block_table.cpu().numpy(), starts, q_len, tokens_per_page)
    slots = np.where(positions >= write_start[:, None], slots, -1)
    ids = torch.tensor([t for s in spans for t in s.token_ids], dtype=torch.int64)
    seq_lens = torch.from_numpy((starts + q_len).astype(np.int32))
    as_long = lambda a: torch.from_numpy(a.reshape(-1))  # noqa: E731
    return UniformBatch(ids, as_long(positions), as_long(slots), block_table, seq_lens, hidden)


class GraphedForward:
    """One forward shape, a model over ``q_len`` tokens per sequence, captured per bucket.

    ``run(batch)`` returns the forward's outputs for the batch's tokens. Static layout:
    int64 buffer ``[ids | positions | slots]``, each ``max_tokens`` long; int32 buffer
    ``[seq_lens (max_batch) | block table (max_batch x max_pages)]``.
    """

    def __init__(
        self,
        forward: ForwardFn,
        kv_pool: torch.Tensor,
        q_len: int,
        window: int,
        buckets: Sequence[int],
        max_pages: int,
        hidden_size: int = 0,
        hidden_dtype: torch.dtype = torch.float32,
        capture: bool = True,
        key_start: int = 0,
    ) -> None:
        self.forward, self.kv_pool, self.q_len, self.window = forward, kv_pool, q_len, window
        self.key_start = key_start
        self.buckets = tuple(sorted(buckets))
        self.max_batch, self.max_pages = self.buckets[-1], max_pages
        self.max_tokens = self.max_batch * q_len
        self.use_graphs = capture
        device = kv_pool.device
        pinned = capture and device.type == "cuda"
        self.host_i64 = torch.zeros(3 * self.max_tokens, dtype=torch.int64, pin_memory=pinned)
        self.host_i32 = torch.zeros(self.max_batch * (1 + max_pages), dtype=torch.int32, pin_memory=pinned)
        self.host_i64[2 * self.max_tokens :] = -1
        self.dev_i64 = self.host_i64.to(device)
        self.dev_i32 = self.host_i32.to(device)
        self.hidden = (
            torch.zeros(self.max_tokens, hidden_size, dtype=hidden_dtype, device=device)
            if hidden_size
            else None
        )
        self.outputs: tuple[torch.Tensor, ...] = ()  # [max_tokens, ...] each
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.copied = torch.cuda.Event() if pinned else None  # staging -> device copy done
        self.replays: Counter[int] = Counter()  # runs per bucket

    # ------------------------------------------------------------ use

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def fits(self, batch: int, q_len: int, width: int) -> bool:
        return q_len == self.q_len and 0 < batch <= self.max_batch and width <= self.max_pages

    def run(self, batch: UniformBatch) -> tuple[torch.Tensor, ...]:
        """Outputs [batch.num_tokens, ...] (copies) of the forward over ``batch``."""
        bucket = self.load(batch)
        self.replay(bucket)
        return tuple(o[: batch.num_tokens].clone() for o in self.outputs)

    def load(self, batch: UniformBatch) -> int:
        """Fill the static inputs (padding rows included); returns the bucket to replay."""
        bucket = self.bucket_for(batch.batch)
        if bucket is None or not self.fits(
            batch.batch, batch.num_tokens // batch.batch, batch.block_table.shape[1]
        ):
            raise ValueError(
                f"batch: {batch.batch} x {batch.num_tokens // batch.batch} tokens "
                f"does not fit the captured shapes"
            )
        if self.copied is not None:
            self.copied.synchronize()  # the staging buffers are free again
        n, t = batch.num_tokens, self.max_tokens
        h64, h32 = self.host_i64.numpy(), self.host_i32.numpy()  # views: numpy writes cost less
        h64[:n] = batch.input_ids.numpy()
        h64[t : t + n] = batch.positions.numpy()
        h64[2 * t : 2 * t + n] = batch.slot_mapping.numpy()
        h64[2 * t + n : 2 * t + bucket * self.q_len] = -1
        b, width = batch.batch, batch.block_table.shape[1]
        h32[:b] = batch.seq_lens.numpy()
        h32[b:bucket] = 0
        table = h32[self.max_batch : self.max_batch + bucket * self.max_pages].reshape(bucket, self.max_pages)
        table[:b, :width] = batch.block_table.cpu().numpy()
        table[:b, width:] = NULL_PAGE
        self._upload(bucket)
        if batch.hidden is not None:
            self.hidden[:n].copy_(batch.hidden)
        return bucket

    def replay(self, bucket: int) -> None:
        """Run the captured forward of ``bucket`` over the loaded inputs."""
        self.replays[bucket] += 1
        if self.use_graphs:
            self.graphs[bucket].replay()
        else:
            self.run_forward(bucket)

    def run_forward(self, bucket: int) -> None:
        """The forward over the static inputs of ``bucket``, launched eagerly; outputs go to
        the static outputs (allocated by the first call, at the largest bucket)."""
        n, t = bucket * self.q_len, self.max_tokens
        ctx = UniformContext(
            self.kv_pool,
            self._table(self.dev_i32, bucket),
            self.dev_i32[:bucket],
            self.dev_i64[2 * t : 2 * t + n],
            self.q_len,
            self.window,
            self.key_start,
        )
        hidden = self.hidden[:n] if self.hidden is not None else None
        self.forward_into(self.dev_i64[:n], self.dev_i64[t : t + n], hidden, ctx)

    def forward_into(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: UniformContext,
    ) -> None:
        """The forward over n = len(input_ids) <= max_tokens tokens, its outputs into the
        static outputs' first n rows (allocated by the first call, at max_tokens: before any
        capture, so outside every graph pool)."""
        n = input_ids.shape[0]
        results = self.forward(input_ids, positions, hidden, ctx)
        if not self.outputs:
            self.outputs = tuple(r.new_empty((self.max_tokens, *r.shape[1:])) for r in results)
        for out, r in zip(self.outputs, results, strict=True):
            out[:n].copy_(r)

    # ------------------------------------------------------------ capture

    def capture(self, pool: tuple[int, int] | None) -> None:
        """Capture every bucket, largest first, into ``pool``: the largest bucket's scratch
        memory then serves every smaller one. Each bucket runs once eagerly first (Triton
        compiles there; the first run also allocates the outputs, outside the pool), and is
        replayed once. All rows are padding then, so no page is read or written."""
        for bucket in reversed(self.buckets):
            self.host_i32.zero_()
            self.host_i64[2 * self.max_tokens :] = -1
            self._upload(self.max_batch)
            self.run_forward(bucket)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.run_forward(bucket)
            graph.replay()  # the first replay uploads the graph: not in a served step
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def _upload(self, bucket: int) -> None:
        used_i32 = self.max_batch + bucket * self.max_pages
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        self.dev_i32[:used_i32].copy_(self.host_i32[:used_i32], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def _table(self, buffer: torch.Tensor, bucket: int) -> torch.Tensor:
        """[bucket, max_pages] view of the block-table part of an int32 buffer."""
        start = self.max_batch
        return buffer[start : start + bucket * self.max_pages].view(bucket, self.max_pages)
