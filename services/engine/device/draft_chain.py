"""The draft chain as one CUDA graph per batch bucket and way of drawing.

After the catch-up forward gives g_n (the drafter's output at slot n of each request, whose
target has valid KV [0, n)), the chain is, for s = 1..K:
  d_s = draw(drafter head(g_{n+s-1}));  and for s < K:
  g_{n+s} = drafter(d_s, g_{n+s-1}) at position n + s (writing the drafter's KV there).
The draw is one of three captured variants (``Draw``): GREEDY takes the argmax; SAMPLED
draws d_s from q_s = the request's temperature and min-p over the head's logits, keyed by
(seed, n + s) in lane DRAFT (``noise.py``), and keeps q_s for the rejection sampler;
FILTERED adds top-k and top-p (a sort of the vocabulary per row, which the others skip).
Each transform a row does not use is an exact identity (``torch.where`` per row), so q_s is
bit for bit what ``probs_for_rows`` gives the same row in the eager chain.
Nothing in it depends on the host once g_n is in place: the positions, KV slots and
sequence lengths of all K - 1 chain forwards follow from each request's n and its block
table, which one upload brings; the graph derives them (``kvcore.ops.slots_at``) and one
replay runs the whole chain. g_n comes in from a separate catch-up forward, or the chain's
graph computes it first (``chain_catch_up.py``: every pending span widened to K + 1
tokens), so a drafting step replays one graph for both. The drafts stay on the device
(``out`` [bucket, K] int64; SAMPLED and FILTERED also ``q`` [bucket, K, vocab] float32)
for the target's verify forward and the acceptance to read.

Rows b .. bucket - 1 of a bucket are padding, as in :mod:`services.engine.device.graphed_forward`:
n = -1 and NULL table rows, so seq_len 0 and slot -1: they touch no page; their drafts are
never read. The chain is token-for-token the eager chain of ``speculative.draft`` on greedy
rows: the same drafter forward at the same bucket shape, and argmax of the head's logits is
the token the eager chain's one-hot sampling picks; the sampled variants draw with the
eager chain's keys.

The graph ends with the target's verify forward over [t_n, d_1 .. d_K] (``chain_verify.py``):
catch-up, chain and verify are one upload of each stage's rows and one replay.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvcore.ops import PagedBatch, slots_at
from kvcore.spec import NULL_PAGE
from services.engine.device.chain_catch_up import ChainCatchUp, PendingSpans
from services.engine.device.chain_verify import ChainVerify
from services.engine.device.graphed_forward import UniformContext
from services.engine.sampling.noise import DRAFT
from services.engine.sampling.sampler import RowParams, argmax_rows, probs_for_rows, sample

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [b, 1, head_dim] float32
# (input_ids [b], hidden [b, hidden_size], the rope of their positions, ctx) -> g [b, hidden_size]
DrafterFn = Callable[[torch.Tensor, torch.Tensor, Rope, UniformContext], torch.Tensor]
RotaryFn = Callable[[torch.Tensor], Rope]  # positions [b] -> their rope
HeadFn = Callable[[torch.Tensor], torch.Tensor]  # g [b, hidden_size] -> logits [b, vocab] float32
GreedyFn = Callable[[torch.Tensor], torch.Tensor]  # g [b, hidden_size] -> argmax of HeadFn's [b] int64


@dataclass(frozen=True, slots=True)
class ChainDrafter:
    """The drafter's forward and its RoPE, apart: the chain computes the rope of all its
    K - 1 steps in one go (the same values each step's forward would compute)."""

    forward: DrafterFn
    rotary: RotaryFn


@dataclass(frozen=True, slots=True)
class ChainHead:
    """The drafter's head: ``logits``, and optionally ``greedy``, their argmax by a cheaper
    route (the same ids)."""

    logits: HeadFn
    greedy: GreedyFn | None = None

    def argmax(self, g: torch.Tensor) -> torch.Tensor:
        """g [b, hidden_size] -> [b] int64: the first maximum of ``logits(g)``."""
        return self.greedy(g) if self.greedy is not None else argmax_rows(self.logits(g))


class Draw(enum.Enum):
    GREEDY = "greedy"
    SAMPLED = "sampled"  # temperature, min-p
    FILTERED = "filtered"  # temperature, top-k, min-p, top-p


@dataclass(frozen=True, slots=True)
class ChainSampling:
    """Per request of a sampled chain: its seed and transforms (temperature 0 = greedy)."""

    seeds: list[int]
    temperature: list[float]
    top_k: list[int]  # <= 0 = off
    top_p: list[float]  # 1 = off
    min_p: list[float]  # 0 = off

    @property
    def draw(self) -> Draw:
        filtered = any(k > 0 for k in self.top_k) or any(p < 1 for p in self.top_p)
        return Draw.FILTERED if filtered else Draw.SAMPLED


@dataclass(frozen=True, slots=True)
class ChainRows:
    """A drafting step's requests, on the host: each one's slot n and token t_n there, its
    draft block-table rows and its rows of each target group's table, [batch, width] int32
    each (the target's in the verify graph's group order)."""

    starts: list[int]
    last_tokens: list[int]
    draft_table: torch.Tensor
    target_tables: tuple[torch.Tensor, ...]


class GraphedDraftChain:
    """K drafts per request from g_n, then the target's verify of them, captured per bucket
    and Draw; K is the verify stage's.

    Static layout: int64 ``[seeds | top_k | starts]``, each ``[max_batch]`` (starts: each
    request's n, -1 on a padding row); int32 block table [max_batch, max_pages]; float32
    ``[temperature | top_p | min_p]``, each ``[max_batch]`` (uploaded for sampled draws
    only); ``g0`` [max_batch, hidden_size]; ``out`` [max_batch, K] int64; ``q`` [max_batch,
    K, vocab] float32; the catch-up stage's own (``catch``, over K + 1 tokens per request) and
    the verify stage's (``verify``).
    """

    def __init__(
        self,
        drafter: ChainDrafter,
        head: ChainHead,
        kv_pool: torch.Tensor,
        shape: ChainShape,
        verify: ChainVerify,
    ) -> None:
        self.drafter, self.head, self.kv_pool, self.shape, self.verify = drafter, head, kv_pool, shape, verify
        k = self.k = verify.k
        steps, mb = k - 1, shape.max_batch
        device = kv_pool.device
        pinned = shape.capture and device.type == "cuda"
        self.host_i64 = torch.zeros(3 * mb, dtype=torch.int64, pin_memory=pinned)
        self.host_i64[2 * mb :] = -1  # every row padding
        self.host_i32 = torch.full((mb * shape.max_pages,), NULL_PAGE, dtype=torch.int32, pin_memory=pinned)
        self.host_f32 = torch.zeros(3 * mb, dtype=torch.float32, pin_memory=pinned)
        self.host_f32[mb : 2 * mb] = 1.0  # top_p off
        self.dev_i64, self.dev_i32 = self.host_i64.to(device), self.host_i32.to(device)
        self.dev_f32 = self.host_f32.to(device)
        self.row_ids = torch.arange(mb, device=device)  # [max_batch]
        self.step_offsets = torch.arange(1, steps + 1, device=device)[:, None]  # [K - 1, 1]
        self.g0 = torch.zeros(mb, shape.hidden_size, dtype=shape.dtype, device=device)
        self.out = torch.zeros(mb, k, dtype=torch.int64, device=device)
        self.q = torch.zeros(mb, k, shape.vocab_size, dtype=torch.float32, device=device)
        self.catch = ChainCatchUp(k + 1, self.g0.new_zeros(mb * (k + 1), shape.hidden_size), pinned)
        self.graphs: dict[tuple[Draw, int, bool], torch.cuda.CUDAGraph] = {}  # (draw, bucket, catch-up in)
        self.copied = torch.cuda.Event() if pinned else None
        self.replays: dict[Draw, int] = dict.fromkeys(Draw, 0)
        self.caught_up = 0  # replays that ran the catch-up stage too

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.shape.buckets if b >= batch), None)

    def run(
        self, rows: ChainRows, first: torch.Tensor | PendingSpans, sampling: ChainSampling | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(drafts [batch, K] int64, q [batch, K, vocab] float32 or None when greedy) on the
        device (views of ``out`` and ``q``: read them before the next run) for ``rows``,
        and the target's verify of them in its verify graph's outputs; ``first``: g_n
        [batch, hidden_size], or the pending spans whose catch-up gives it (which
        ``self.catch.fits``), run in the same graph; ``sampling`` None: greedy. None when
        the batch does not fit the captured shapes."""
        loaded = self.load(rows, sampling)
        if loaded is None:
            return None
        bucket, draw = loaded
        catching_up = isinstance(first, PendingSpans)
        if catching_up:
            self.catch.load(first, bucket)
        else:
            self.g0[: len(rows.starts)].copy_(first)
        return self.replay(bucket, draw, catching_up, len(rows.starts))

    def load(self, rows: ChainRows, sampling: ChainSampling | None) -> tuple[int, Draw] | None:
        """Upload ``rows``' n, t_n, tables and draws (the catch-up stage's inputs or g_n
        are the caller's); (bucket, draw), or None when the batch does not fit."""
        batch, table = len(rows.starts), rows.draft_table
        bucket = self.bucket_for(batch)
        if bucket is None or table.shape[1] > self.shape.max_pages:
            return None
        if not self.verify.fits(batch, rows.target_tables[0].shape[1]):
            return None
        self._load(rows.starts, table.cpu().numpy(), bucket, sampling)
        self.verify.load(rows.last_tokens, [t.cpu().numpy() for t in rows.target_tables], bucket)
        return bucket, sampling.draw if sampling is not None else Draw.GREEDY

    def go_on(self, starts: torch.Tensor, last_tokens: torch.Tensor) -> None:
        """Device values [m] int64 over the uploaded n and t_n of the first m rows: a step
        launched before its predecessor was read (``spec_overlap.py``), in stream order."""
        m, mb = starts.shape[0], self.shape.max_batch
        self.dev_i64[2 * mb : 2 * mb + m].copy_(starts)
        self.verify.dev[:m].copy_(last_tokens)  # int64 -> int32

    def replay(
        self, bucket: int, draw: Draw, catching_up: bool, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the loaded chain (and verify) of ``bucket``; ``run``'s result for ``batch`` rows."""
        self.verify.target.replays[bucket] += 1  # the target's verify forward, in this graph
        self.caught_up += catching_up
        self.replays[draw] += 1
        if self.shape.capture:
            self.graphs[draw, bucket, catching_up].replay()
        else:
            self._chain(bucket, draw, catching_up)
        return self.out[:batch], (self.q[:batch] if draw is not Draw.GREEDY else None)

    def capture(self, pool: tuple[int, int] | None) -> None:
        """Every bucket, largest first, every Draw, with and without the catch-up stage,
        into ``pool``; all rows padding while capturing."""
        for bucket in reversed(self.shape.buckets):
            for draw, catching_up in ((d, c) for d in Draw for c in (False, True)):
                empty = np.zeros((0, 0), dtype=np.int32)
                self._load([], empty, bucket)
                self.verify.load([], [empty] * self.verify.num_groups, bucket)
                self._chain(bucket, draw, catching_up)  # eager once: Triton compiles here
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._chain(bucket, draw, catching_up)
                graph.replay()  # the first replay uploads the graph: not in a served step
                self.graphs[draw, bucket, catching_up] = graph
        torch.cuda.synchronize()

    @property
    def _steps(self) -> int:
        return self.k - 1

    def _chain(self, bucket: int, draw: Draw, catching_up: bool) -> None:
        """The chain over the static inputs of ``bucket``, from the catch-up stage's g_n or
        from ``g0``; drafts into ``out[:bucket]`` (and q into ``q[:bucket]`` unless GREEDY),
        then the target's verify forward of them."""
        g = self._catch_up(bucket) if catching_up else self.g0[:bucket]
        inputs = self._step_inputs(bucket)
        drafts = []
        for s in range(self.k):
            if s:
                rope, ctx = inputs[s - 1]
                g = self.drafter.forward(drafts[-1], g, rope, ctx)
            if draw is Draw.GREEDY:
                drafts.append(self.head.argmax(g))
                continue
            logits = self.head.logits(g)  # [bucket, vocab]
            q = probs_for_rows(logits, self._row_params(bucket, draw))
            seeds, starts = self._i64_row(0, bucket), self._i64_row(2, bucket)
            drafts.append(sample(q, seeds, starts + s + 1, DRAFT))
            self.q[:bucket, s].copy_(q)
        self.out[:bucket].copy_(torch.stack(drafts, dim=1))
        self.verify.run(bucket, self._i64_row(2, bucket), self.out[:bucket])

    def _catch_up(self, bucket: int) -> torch.Tensor:
        """g_n [bucket, hidden_size]: the drafter over each request's pending span widened
        to L tokens, its last row."""
        table = self._table(bucket)
        ids, positions, slots, seq_lens, hidden = self.catch.inputs(bucket, table, self.shape.tokens_per_page)
        L = self.catch.q_len
        ctx = self._context(table, seq_lens, slots, L)
        rope = self.drafter.rotary(positions)
        g = self.drafter.forward(ids, hidden, rope, ctx)  # [bucket * L, hidden_size]
        return g.view(bucket, L, -1)[:, -1].contiguous()

    def _row_params(self, bucket: int, draw: Draw) -> RowParams:
        """The sampled variants' transforms over the static rows; every flag on, so no
        transform depends on the device's values (the off rows pass through exactly)."""
        mb = self.shape.max_batch
        f32 = lambda i: self.dev_f32[i * mb : i * mb + bucket]  # noqa: E731
        filtered = draw is Draw.FILTERED
        return RowParams(
            f32(0),
            f32(1),
            top_k=self._i64_row(1, bucket) if filtered else None,
            min_p=f32(2),
            top_k_max=self.shape.vocab_size if filtered else 0,
            any_greedy=True,
            any_top_p=filtered,
        )

    def _i64_row(self, i: int, bucket: int) -> torch.Tensor:
        """Row i of the per-request int64 buffer: 0 seeds, 1 top_k, 2 starts."""
        at = i * self.shape.max_batch
        return self.dev_i64[at : at + bucket]

    def _step_inputs(self, bucket: int) -> list[tuple[Rope, UniformContext]]:
        """(rope, context) of chain steps 1..K-1 (step s: the rope of position n + s, its
        slot, seq_len n + s + 1), derived on the device from the uploaded n and table rows;
        the rope of every step from one call."""
        n = self._i64_row(2, bucket)  # [bucket], -1 on padding rows
        positions = n + self.step_offsets  # [K - 1, bucket]
        table, shape = self._table(bucket), self.shape
        slots = slots_at(table, self.row_ids[:bucket], positions, shape.tokens_per_page)  # [K - 1, bucket]
        seq_lens = ((positions + 1) * (n >= 0)).to(torch.int32)  # [K - 1, bucket]
        ropes = self.drafter.rotary(positions.reshape(-1))  # cos, sin [(K - 1) * bucket, 1, head_dim]
        cos, sin = (r.view(self._steps, bucket, *r.shape[1:]) for r in ropes)
        contexts = [self._context(table, seq_lens[s], slots[s], 1) for s in range(self._steps)]
        return [((cos[s], sin[s]), ctx) for s, ctx in enumerate(contexts)]

    def _context(
        self, table: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor, q_len: int
    ) -> UniformContext:
        """The draft group's context over ``q_len`` tokens per row: table [bucket, max_pages],
        seq_lens [bucket] int32, slots [bucket * q_len] (-1: not written)."""
        shape = self.shape
        batch = PagedBatch(table, seq_lens, q_len, window=shape.window, key_start=shape.key_start)
        return UniformContext(self.kv_pool, batch, slots)

    def _load(
        self, starts: list[int], host_table: np.ndarray, bucket: int, sampling: ChainSampling | None = None
    ) -> None:
        """Each request's n, table rows and draws (padding rows: n = -1, NULL rows, greedy),
        written through numpy views of the staging buffers (a torch call on a small CPU
        tensor costs several us), then uploaded."""
        if self.copied is not None:
            self.copied.synchronize()  # the staging buffers are free again
        mb, b, width = self.shape.max_batch, len(starts), host_table.shape[1]
        seeds, top_k, n = self.host_i64.numpy().reshape(3, mb)
        n[:b], n[b:bucket] = starts, -1
        if sampling is not None:
            params = self.host_f32.numpy().reshape(3, mb)  # temperature, top_p, min_p
            seeds[:b], top_k[:b], seeds[b:bucket], top_k[b:bucket] = sampling.seeds, sampling.top_k, 0, 0
            params[:, :b] = (sampling.temperature, sampling.top_p, sampling.min_p)
            params[:, b:bucket] = ((0.0,), (1.0,), (0.0,))
        rows = self.host_i32.numpy()[: bucket * self.shape.max_pages].reshape(bucket, self.shape.max_pages)
        rows[:b, :width] = host_table
        rows[:b, width:] = NULL_PAGE
        rows[b:] = NULL_PAGE
        self._upload(bucket, sampling is not None)

    def _upload(self, bucket: int, sampled: bool) -> None:
        used = bucket * self.shape.max_pages
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        self.dev_i32[:used].copy_(self.host_i32[:used], non_blocking=True)
        if sampled:
            self.dev_f32.copy_(self.host_f32, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def _table(self, bucket: int) -> torch.Tensor:
        """[bucket, max_pages] view of the block table on the device."""
        width = self.shape.max_pages
        return self.dev_i32[: bucket * width].view(bucket, width)


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
    vocab_size: int  # of the head's logits (the target's ids)
    capture: bool = True

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]
