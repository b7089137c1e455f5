"""The greedy draft chain as one CUDA graph per batch bucket.

After the catch-up forward gives g_n (the drafter's output at slot n of each request, whose
target has valid KV [0, n)), the chain is, for s = 1..K:
  d_s = argmax(drafter head(g_{n+s-1}));  and for s < K:
  g_{n+s} = drafter(d_s, g_{n+s-1}) at position n + s (writing the drafter's KV there).
Nothing in it depends on the host once g_n is in place: the positions, KV slots and
sequence lengths of all K - 1 chain forwards are known before the chain starts, so one
upload fills them and one replay runs the whole chain. The drafts stay on the device
(``out`` [bucket, K] int64) for the target's verify forward to read.

Rows b .. bucket - 1 of a bucket are padding, as in :mod:`services.engine.graphed_forward`:
seq_len 0 and slot -1, so they touch no page; their drafts are never read. The chain is
token-for-token the eager chain of ``speculative.draft`` on greedy rows: the same drafter
forward at the same bucket shape, and argmax of the head's logits is the token the eager
chain's one-hot sampling picks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcore.ops import slot_mapping_for
from kvcore.spec import NULL_PAGE
from services.engine.graphed_forward import UniformContext

# (input_ids [b], hidden [b, hidden_size], positions [b], ctx) -> g [b, hidden_size]
DrafterFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, UniformContext], torch.Tensor]
HeadFn = Callable[[torch.Tensor], torch.Tensor]  # g [b, hidden_size] -> logits [b, vocab] float32


class GraphedDraftChain:
    """K greedy drafts per request from g_n, captured per bucket.

    Static layout: int64 ``[positions | slots]``, each ``[K - 1, max_batch]`` (chain step
    s - 1 at row s - 1); int32 ``[seq_lens [K - 1, max_batch] | block table [max_batch,
    max_pages]]``; ``g0`` [max_batch, hidden_size]; ``out`` [max_batch, K] int64.
    """

    def __init__(
        self,
        drafter: DrafterFn,
        head: HeadFn,
        kv_pool: torch.Tensor,
        k: int,
        shape: ChainShape,
    ) -> None:
        self.drafter, self.head, self.kv_pool, self.k, self.shape = drafter, head, kv_pool, k, shape
        steps, mb = k - 1, shape.max_batch
        device = kv_pool.device
        pinned = shape.capture and device.type == "cuda"
        self.host_i64 = torch.zeros(2 * steps * mb, dtype=torch.int64, pin_memory=pinned)
        self.host_i32 = torch.zeros(steps * mb + mb * shape.max_pages, dtype=torch.int32, pin_memory=pinned)
        self.dev_i64, self.dev_i32 = self.host_i64.to(device), self.host_i32.to(device)
        self.g0 = torch.zeros(mb, shape.hidden_size, dtype=shape.dtype, device=device)
        self.out = torch.zeros(mb, k, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.copied = torch.cuda.Event() if pinned else None
        self.replays = 0

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.shape.buckets if b >= batch), None)

    def run(self, starts: list[int], table: torch.Tensor, g0: torch.Tensor) -> torch.Tensor | None:
        """Drafts [batch, K] int64 on the device (a view of ``out``: read it before the next
        run) for requests whose slot n = ``starts[i]`` gave g0[i] ([batch, hidden_size]);
        ``table`` [batch, width] is their draft block-table rows (host). None when the batch
        does not fit the captured shapes."""
        batch = len(starts)
        bucket = self.bucket_for(batch)
        if bucket is None or table.shape[1] > self.shape.max_pages:
            return None
        self._load(starts, table, bucket)
        self.g0[:batch].copy_(g0)
        self.replays += 1
        if self.shape.capture:
            self.graphs[bucket].replay()
        else:
            self._chain(bucket)
        return self.out[:batch]

    def capture(self, pool: tuple[int, int] | None) -> None:
        """Every bucket, largest first, into ``pool``; all rows padding while capturing."""
        for bucket in reversed(self.shape.buckets):
            self.host_i32.zero_()
            self.host_i64.zero_()
            self.host_i64[self._steps * self.shape.max_batch :] = -1
            self._upload()
            self._chain(bucket)  # eager once: Triton compiles here
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._chain(bucket)
            graph.replay()  # the first replay uploads the graph: not in a served step
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    @property
    def _steps(self) -> int:
        return self.k - 1

    def _chain(self, bucket: int) -> None:
        """The chain over the static inputs of ``bucket``; drafts into ``out[:bucket]``."""
        g = self.g0[:bucket]
        d = self.head(g).argmax(dim=-1)  # [bucket]
        drafts = [d]
        for s in range(self._steps):
            positions, ctx = self._step_inputs(s, bucket)
            g = self.drafter(d, g, positions, ctx)
            d = self.head(g).argmax(dim=-1)
            drafts.append(d)
        self.out[:bucket].copy_(torch.stack(drafts, dim=1))

    def _step_inputs(self, s: int, bucket: int) -> tuple[torch.Tensor, UniformContext]:
        mb = self.shape.max_batch
        at = s * mb
        positions = self.dev_i64[at : at + bucket]
        slots = self.dev_i64[self._steps * mb + at : self._steps * mb + at + bucket]
        seq_lens = self.dev_i32[at : at + bucket]
        ctx = UniformContext(
            self.kv_pool,
            self._table(self.dev_i32, bucket),
            seq_lens,
            slots,
            1,
            self.shape.window,
            self.shape.key_start,
        )
        return positions, ctx

    def _load(self, starts: list[int], table: torch.Tensor, bucket: int) -> None:
        """Host-side inputs of chain steps 1..K-1 (position n + s, slot, seq_len n + s + 1)."""
        if self.copied is not None:
            self.copied.synchronize()  # the staging buffers are free again
        steps, mb, b = self._steps, self.shape.max_batch, len(starts)
        self.host_i64.zero_()
        self.host_i64[steps * mb :] = -1
        self.host_i32[: steps * mb] = 0
        if steps:
            n = torch.tensor(starts, dtype=torch.int64)
            slots = slot_mapping_for(table, n + 1, [steps] * b, self.shape.tokens_per_page)
            pos = n[None, :] + torch.arange(1, steps + 1)[:, None]  # [steps, b]
            self.host_i64[: steps * mb].view(steps, mb)[:, :b] = pos
            self.host_i64[steps * mb :].view(steps, mb)[:, :b] = slots.view(b, steps).T
            self.host_i32[: steps * mb].view(steps, mb)[:, :b] = (pos + 1).int()
        rows = self._table(self.host_i32, bucket)
        rows[:b, : table.shape[1]] = table
        rows[:b, table.shape[1] :] = NULL_PAGE
        rows[b:] = NULL_PAGE
        self._upload()

    def _upload(self) -> None:
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        self.dev_i32.copy_(self.host_i32, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def _table(self, buffer: torch.Tensor, bucket: int) -> torch.Tensor:
        """[bucket, max_pages] view of the block-table part of an int32 buffer."""
        start, width = self._steps * self.shape.max_batch, self.shape.max_pages
        return buffer[start : start + bucket * width].view(bucket, width)


@dataclass(frozen=True, slots=True)
class ChainShape:
    """What a chain is captured for. ``capture`` False: the same static-buffer path runs
    eagerly (on CPU, and in the tests of its padding rules)."""

    buckets: tuple[int, ...]  # ascending batch buckets
    max_pages: int  # block-table width
    hidden_size: int  # the drafter's
    dtype: torch.dtype  # of g
    window: int  # the drafter's attention window, 0 = none
    key_start: int  # first position attended as a key
    tokens_per_page: int
    capture: bool = True

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]
