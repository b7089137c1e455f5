"""One graphed forward shape: a model over ``q_len`` tokens per sequence, per batch bucket.

Each bucket (1, 2, 4, 8, 16, 32, 64, ...) is captured once, largest first, all into one
memory pool, and later replayed over static input buffers:

- b requests run in the smallest bucket >= b. Rows b .. bucket - 1 are padding: their
  KV slots are -1 (the KV write skips them) and their seq_len is 0 (attention reads no
  key and outputs zeros), so they touch no page;
- attention goes through ``decode_attention`` / ``verify_attention``, whose query length
  is a Python int: nothing in the forward reads a device value back, so it captures;
- a forward attends one or more layer groups (the target's, one per window of a
  per-layer mix; the drafter's one), each with its own pool, block table and slots;
- the inputs live in two device buffers (int64: ids | positions | slots of each group;
  int32: seq_lens | block table of each group), each refilled by one copy from pinned
  host staging;
- outputs are copied into buffers allocated before any capture, outside the graph pool,
  so no graph's scratch memory aliases them; callers get copies.

Without CUDA (``capture=False``) the same static-buffer path runs the forward directly:
that is how the CPU tests check the padding rules.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcore.ops import AttentionParams, PagedBatch, decode_attention, uniform_slots, verify_attention
from kvcore.spec import NULL_PAGE
from services.engine.batch import Span
from services.engine.models import LayerContexts, layer_contexts
from services.engine.models.attention import WritesPages

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# (input_ids [n], positions [n], hidden [n, hidden_size] or None, ctx: one UniformContext
# per layer group) -> outputs [n, ...]
ForwardFn = Callable[
    [torch.Tensor, torch.Tensor, "torch.Tensor | None", LayerContexts], tuple[torch.Tensor, ...]
]


@dataclass(frozen=True, slots=True)
class PagedGroup:
    """A layer group a graphed forward attends: the model's layers in it (in its pool's
    order), its pool, window and first key position."""

    name: str
    layer_ids: tuple[int, ...]
    kv_pool: torch.Tensor  # [num_pages, num_layers, 2, num_kv_heads, tokens_per_page, head_dim]
    window: int = 0
    key_start: int = 0


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The standard buckets up to the first that holds ``max_batch``: 12 -> (1, 2, 4, 8, 16).
    Past the largest standard bucket, batches run eagerly."""
    if max_batch < 1:
        raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
    smaller = [b for b in BATCH_BUCKETS if b < max_batch]
    return (*smaller, next((b for b in BATCH_BUCKETS if b >= max_batch), BATCH_BUCKETS[-1]))


@dataclass(slots=True)
class UniformContext(WritesPages):
    """KV context of a uniform batch: every sequence has ``q_len`` query tokens, the last
    ``q_len`` positions of its ``seq_lens``. Padding rows: seq_len 0, slots -1."""

    kv_pool: torch.Tensor  # [num_pages, num_layers, 2, num_kv_heads, tokens_per_page, head_dim]
    batch: PagedBatch  # uniform: no query starts, max_q_len = q_len
    slot_mapping: torch.Tensor  # [batch * q_len] int64, -1 = do not write

    @property
    def q_len(self) -> int:
        return self.batch.max_q_len

    def _attend_written(self, layer: int, q: torch.Tensor, params: AttentionParams) -> torch.Tensor:
        if self.q_len == 1:
            return decode_attention(q, self.kv_pool, layer, self.batch, params)
        out = verify_attention(q.view(-1, self.q_len, *q.shape[1:]), self.kv_pool, layer, self.batch, params)
        return out.view(q.shape)


def uniform_context(
    group: PagedGroup, block_table: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor, q_len: int
) -> UniformContext:
    """``group``'s context over a uniform batch: block_table [batch, max_pages] int32,
    seq_lens [batch] int32, slots [batch * q_len] int64 (-1: not written)."""
    batch = PagedBatch(block_table, seq_lens, q_len, window=group.window, key_start=group.key_start)
    return UniformContext(group.kv_pool, batch, slots)


def uniform_q_len(ctx: LayerContexts) -> int:
    """The query tokens per sequence of a graphed forward's contexts."""
    return ctx.groups[0].ctx.q_len


@dataclass(slots=True)
class UniformBatch:
    """One forward's inputs on the host: ``batch`` sequences of ``q_len`` tokens each; the
    slots and block tables of each layer group, in the forward's group order."""

    input_ids: torch.Tensor  # [batch * q_len] int64
    positions: torch.Tensor  # [batch * q_len] int64
    slot_mappings: tuple[torch.Tensor, ...]  # per group [batch * q_len] int64, -1 = do not write
    block_tables: tuple[torch.Tensor, ...]  # per group [batch, width] int32, NULL_PAGE padded
    seq_lens: torch.Tensor  # [batch] int32
    hidden: torch.Tensor | None = None  # [batch * q_len, hidden_size] on the device, or None

    @property
    def batch(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def uniform_batch(
    spans: Sequence[Span],
    block_tables: Sequence[torch.Tensor],
    tokens_per_page: int,
    hidden: torch.Tensor | None = None,
) -> UniformBatch:
    """Host-side inputs of spans that all have the same length; ``block_tables``: per layer
    group, their rows [batch, width]. KV is written only at positions >= each span's
    write_start."""
    q_len, batch = len(spans[0].token_ids), len(spans)
    starts = np.fromiter((s.start for s in spans), np.int64, batch)
    write_start = np.fromiter((s.write_start for s in spans), np.int64, batch)
    positions = starts[:, None] + np.arange(q_len)  # [batch, q_len]
    written = positions >= write_start[:, None]
    as_long = lambda a: torch.from_numpy(a.reshape(-1))  # noqa: E731
    slots = tuple(
        as_long(np.where(written, uniform_slots(t.cpu().numpy(), starts, q_len, tokens_per_page), -1))
        for t in block_tables
    )
    ids = torch.tensor([t for s in spans for t in s.token_ids], dtype=torch.int64)
    seq_lens = torch.from_numpy((starts + q_len).astype(np.int32))
    return UniformBatch(ids, as_long(positions), slots, tuple(block_tables), seq_lens, hidden)


class GraphedForward:
    """One forward shape, a model over ``q_len`` tokens per sequence, captured per bucket.

    ``run(batch)`` returns the forward's outputs for the batch's tokens. Static layout, with
    G layer groups: int64 buffer ``[ids | positions | slots of group 0 | ... | of group
    G - 1]``, each ``max_tokens`` long; int32 buffer ``[seq_lens (max_batch) | block table
    of group 0 (max_batch x max_pages) | ... | of group G - 1]``.
    """

    def __init__(
        self,
        forward: ForwardFn,
        groups: Sequence[PagedGroup],
        q_len: int,
        buckets: Sequence[int],
        max_pages: int,
        hidden_size: int = 0,
        hidden_dtype: torch.dtype = torch.float32,
        capture: bool = True,
    ) -> None:
        self.forward, self.groups, self.q_len = forward, tuple(groups), q_len
        self.buckets = tuple(sorted(buckets))
        self.max_batch, self.max_pages = self.buckets[-1], max_pages
        self.max_tokens = self.max_batch * q_len
        self.use_graphs = capture
        device = self.device = self.groups[0].kv_pool.device
        pinned = capture and device.type == "cuda"
        num_groups = len(self.groups)
        self.host_i64 = torch.zeros((2 + num_groups) * self.max_tokens, dtype=torch.int64, pin_memory=pinned)
        self.host_i32 = torch.zeros(
            self.max_batch * (1 + num_groups * max_pages), dtype=torch.int32, pin_memory=pinned
        )
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

    def load(self, batch: UniformBatch, ids: torch.Tensor | None = None) -> int:
        """Fill the static inputs (padding rows included); returns the bucket to replay.
        ``ids``: [m <= batch.num_tokens] int64 on the device, copied over the host's first m
        token ids once they are up (a step whose inputs its predecessor sampled,
        ``overlap.py``)."""
        bucket = self.bucket_for(batch.batch)
        if bucket is None or not self.fits(
            batch.batch, batch.num_tokens // batch.batch, batch.block_tables[0].shape[1]
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
        b = batch.batch
        h32[:b] = batch.seq_lens.numpy()
        h32[b:bucket] = 0
        for g, (slots, rows) in enumerate(zip(batch.slot_mappings, batch.block_tables, strict=True)):
            at = (2 + g) * t
            h64[at : at + n] = slots.numpy()
            h64[at + n : at + bucket * self.q_len] = -1
            table = self._table(h32, bucket, g)
            table[:b, : rows.shape[1]] = rows.cpu().numpy()
            table[:b, rows.shape[1] :] = NULL_PAGE
        self._upload(bucket)
        if ids is not None:
            self.dev_i64[: ids.shape[0]].copy_(ids)
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
        contexts = [
            uniform_context(
                group,
                self._table(self.dev_i32, bucket, g),
                self.dev_i32[:bucket],
                self.dev_i64[(2 + g) * t : (2 + g) * t + n],
                self.q_len,
            )
            for g, group in enumerate(self.groups)
        ]
        ctx = layer_contexts(self.groups, contexts)
        hidden = self.hidden[:n] if self.hidden is not None else None
        self.forward_into(self.dev_i64[:n], self.dev_i64[t : t + n], hidden, ctx)

    def forward_into(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: LayerContexts,
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
        """Copy the staging buffers up: the int32 one up to the last group's ``bucket`` rows."""
        used_i32 = self.max_batch * (1 + (len(self.groups) - 1) * self.max_pages) + bucket * self.max_pages
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        self.dev_i32[:used_i32].copy_(self.host_i32[:used_i32], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def _table(self, buffer: Any, bucket: int, group: int = 0) -> Any:
        """[bucket, max_pages] view of ``group``'s block table in an int32 buffer."""
        return table_rows(buffer, self.max_batch, self.max_pages, bucket, group)


def table_rows(buffer: Any, max_batch: int, max_pages: int, bucket: int, group: int) -> Any:
    """[bucket, max_pages] view of ``group``'s block table in an int32 buffer (a tensor or
    its numpy view) laid out ``[max_batch values | G tables of max_batch x max_pages]``."""
    start = max_batch * (1 + group * max_pages)
    return buffer[start : start + bucket * max_pages].reshape(bucket, max_pages)
