"""CUDA graphs for the decode step.

A decode step runs the same shapes over and over: the target's verify forward over K + 1
tokens per request, the drafter's catch-up over at most K + 1 tokens per request (padded
at the front to K + 1) and its chain steps over one token per request. Each is one
:class:`~services.engine.device.graphed_forward.GraphedForward`, captured per batch bucket. The
target's graphs also run its head and the greedy verdict (``rejection.greedy_verdict``), so
a greedy step reads back one small tensor and launches nothing after the replay. A drafting
device-resident step replays the draft chain's graph alone: it ends with the target's verify
forward (``chain_verify.py``), into the target graph's outputs.

Everything else runs eagerly: target spans not all of the captured length (prefill
chunks, unless they happen to be), drafter spans longer than K + 1 or too close to
position 0 to pad, batches past the largest bucket, block tables wider than the static
one. The engine builds the graphs and hands them to the runner (``runner.graphs``); the
runner never imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore import DRAFT_GROUP
from kvcore.spec import cdiv
from services.engine.batch import Span, TargetRun
from services.engine.device.chain_catch_up import pad_fits
from services.engine.device.chain_verify import ChainVerify
from services.engine.device.draft_chain import ChainDrafter, ChainHead, ChainShape, GraphedDraftChain
from services.engine.device.graphed_forward import (
    BATCH_BUCKETS,
    GraphedForward,
    PagedGroup,
    UniformBatch,
    UniformContext,
    batch_buckets,
    uniform_batch,
    uniform_q_len,
)
from services.engine.models import LayerContexts, model_dtype
from services.engine.models.eagle import DRAFT_KEY_START
from services.engine.runner import ModelRunner
from services.engine.sampling.sampler import argmax_rows
from services.engine.speculation.rejection import greedy_verdict

LAG_TOKENS = 16  # the longest catch-up span graphed: steps without drafts may lag this far

__all__ = [
    "BATCH_BUCKETS",
    "DecodeGraphs",
    "GraphedForward",
    "PagedGroup",
    "UniformBatch",
    "UniformContext",
    "batch_buckets",
    "capture_decode_graphs",
    "pad_front",
    "uniform_batch",
]


def pad_front(spans: Sequence[Span], q_len: int) -> tuple[list[Span], torch.Tensor] | None:
    """Spans of at most ``q_len`` tokens widened to exactly ``q_len`` by starting earlier.

    The added front positions only pad: they write no KV (write_start stays at the span's
    own start), and their outputs are dropped, so the real queries see exactly the keys
    they would see alone. Returns (padded spans, rows [num_real_tokens] of the real tokens
    in the padded batch), or None if a span is longer than ``q_len`` or starts too early
    to widen."""
    if not pad_fits([s.start for s in spans], [len(s.token_ids) for s in spans], q_len):
        return None
    padded, rows = [], []
    for i, s in enumerate(spans):
        pad = q_len - len(s.token_ids)
        padded.append(
            Span(s.request_id, s.start - pad, [0] * pad + list(s.token_ids), max(s.write_start, s.start))
        )
        rows.extend(range(i * q_len + pad, (i + 1) * q_len))
    return padded, torch.tensor(rows, dtype=torch.int64)


class DecodeGraphs:
    """The engine's graphed forwards: the target over ``verify_len`` tokens per request
    (K + 1; 1 without a drafter) and, with a drafter, over one (``plain``: a step that
    drafts nothing, see adaptive_k.py), the drafter over ``verify_len`` (catch-up) and over
    one token per request (chain steps), and the draft chain (draft_chain.py). The target's
    graphs attend every one of its layer groups (``runner.target_groups``, in that order)."""

    def __init__(
        self, runner: ModelRunner, verify_len: int, max_batch: int, max_model_len: int, capture: bool = True
    ) -> None:
        self.runner = runner
        # [1] int64: the greedy verdict's forced acceptance (benchmarks only), -1 = off
        self.forced = torch.full((1,), -1, dtype=torch.int64, device=runner.device)
        self._forced = -1  # its value, on the host
        manager = runner.manager
        buckets = batch_buckets(max_batch)
        max_pages = cdiv(max_model_len + manager.config.headroom_tokens, manager.tokens_per_page) + 1
        dtype = model_dtype(runner.target)
        pools = runner.kv_pools
        targets = [
            PagedGroup(g.name, g.layer_ids, pools.tensor(g.name), g.window) for g in runner.target_groups
        ]
        target_graph = lambda q_len: GraphedForward(
            self._target_forward, targets, q_len, buckets, max_pages, capture=capture
        )
        self.target = target_graph(verify_len)
        self.plain = target_graph(1) if verify_len > 1 else None  # steps without drafts
        self.drafter = self.catch_up = self.lagged = None
        self.chain: GraphedDraftChain | None = None  # drafts on the device, K >= 1
        if runner.drafter is not None:
            d = runner.drafter.config
            draft = PagedGroup(
                DRAFT_GROUP,
                tuple(range(d.num_hidden_layers)),
                pools.tensor(DRAFT_GROUP),
                runner.draft_window,
                DRAFT_KEY_START,
            )
            drafter_graph = lambda q_len: GraphedForward(
                self._drafter_forward, [draft], q_len, buckets, max_pages, d.hidden_size, dtype, capture
            )
            self.drafter = drafter_graph(1)
            if verify_len > 1:
                self.catch_up = drafter_graph(verify_len)
                self.lagged = drafter_graph(LAG_TOKENS) if LAG_TOKENS > verify_len else None
                self.chain = self._draft_chain(buckets, max_pages, capture)
        self._capture = capture

    def capture(self) -> None:
        """Target buckets, then the drafter's, largest first, into one pool."""
        if not self._capture:
            return
        pool = torch.cuda.graph_pool_handle()
        for graphed in (self.target, self.plain, self.catch_up, self.lagged, self.drafter, self.chain):
            if graphed is not None:
                graphed.capture(pool)

    def reset_replays(self) -> None:
        """Every graph's replay counters back to zero (after the warm-up's steps)."""
        for graphed in (self.target, self.plain, self.catch_up, self.lagged, self.drafter):
            if graphed is not None:
                graphed.replays.clear()
        if self.chain is not None:
            self.chain.replays = dict.fromkeys(self.chain.replays, 0)
            self.chain.caught_up = 0

    def force_acceptance(self, n: int) -> None:
        """Greedy verdicts keep exactly min(n, K) drafts from now on (benchmarks only, not
        lossless); n = -1: off. A device value: the captured graphs read it at replay."""
        if n != self._forced:
            self.forced.fill_(n)
            self._forced = n

    def run_target(self, spans: list[Span]) -> TargetRun | None:
        """The target's forward through a graph (K + 1 tokens per span, or one: a step
        without drafts), or None when the spans do not fit one."""
        for graphed in (self.target, self.plain):
            batch = self._batch(graphed, spans) if graphed is not None else None
            if batch is not None:
                graphed.replay(graphed.load(batch))
                return self._target_run(graphed, batch.num_tokens)
        return None

    def run_drafter(self, spans: list[Span], hidden: torch.Tensor) -> torch.Tensor | None:
        """The drafter's forward through a graph, or None when the spans do not fit one.
        Chain steps (one token each) take the one-token graph; catch-up spans of up to
        K + 1 tokens are padded at the front to K + 1, longer ones up to LAG_TOKENS to
        LAG_TOKENS (see :func:`pad_front`)."""
        if self.drafter is None or not spans:
            return None
        if all(len(s.token_ids) == 1 for s in spans):
            batch = self._batch(self.drafter, spans, hidden)
            return self.drafter.run(batch)[0] if batch is not None else None
        for graphed in (self.catch_up, self.lagged):
            if graphed is not None and (padded := pad_front(spans, graphed.q_len)) is not None:
                return self._padded_drafter(graphed, padded, hidden)
        return None

    @property
    def lag_tokens(self) -> int:
        """The longest catch-up span a graph takes (0 without a drafter)."""
        graphed = self.lagged or self.catch_up
        return graphed.q_len if graphed is not None else 0

    def _padded_drafter(
        self, graphed: GraphedForward, padded: tuple[list[Span], torch.Tensor], hidden: torch.Tensor
    ) -> torch.Tensor | None:
        padded_spans, rows = padded
        rows = rows.to(hidden.device)
        padded_hidden = hidden.new_zeros((len(padded_spans) * graphed.q_len, hidden.shape[1]))
        padded_hidden[rows] = hidden
        batch = self._batch(graphed, padded_spans, padded_hidden)
        return graphed.run(batch)[0][rows] if batch is not None else None

    def run_verify(
        self,
        spans: list[Span],
        tables: Sequence[torch.Tensor] | None = None,
        ids: torch.Tensor | None = None,
    ) -> TargetRun | None:
        """The target's one-token graph over ``spans`` [t_n] (a step without drafts; a
        drafting step's verify runs inside the chain's graph, :meth:`verified`). ``tables``:
        the spans' rows of each target group's table, when the caller has them; ``ids``:
        the first spans' tokens [m] on the device, in place of their host ``token_ids``.
        None when the spans do not fit the graph."""
        target = self.target if self.target.q_len == 1 else self.plain
        batch = self._batch(target, spans, tables=tables) if target is not None else None
        if batch is None:
            return None
        bucket = target.load(batch, ids)
        target.replay(bucket)
        return self._target_run(target, batch.num_tokens)

    def verified(self, batch: int) -> TargetRun:
        """The verify forward of the draft chain's last run, over ``batch`` requests."""
        return self._target_run(self.target, batch * self.target.q_len)

    def _target_run(self, graphed: GraphedForward, n: int) -> TargetRun:
        """The target graph's outputs for its first ``n`` tokens: copies of the hidden rows
        and features, views of the logits and verdict (read before its next replay)."""
        states = [o[:n].clone() for o in graphed.outputs[:-2]]  # hidden, then features
        logits, verdict = (o[:n] for o in graphed.outputs[-2:])
        return TargetRun(states[0], states[1] if len(states) > 1 else None, logits, verdict)

    def fits_verify(self, batch: int, k: int, widths: tuple[int, int]) -> bool:
        """Whether a device-resident step of ``batch`` requests with ``k`` drafts each (the
        chain's K, or 0: also without a drafter) fits the chain and verify graphs;
        ``widths``: the (target, draft) block tables' widths in pages."""
        target_width, draft_width = widths
        if k and (self.chain is None or k != self.chain.k):
            return False
        target = self.target if self.target.q_len == k + 1 else self.plain
        if target is None or not target.fits(batch, k + 1, target_width):
            return False
        if not k:
            return True
        return self.chain.bucket_for(batch) is not None and draft_width <= self.chain.shape.max_pages

    def _draft_chain(self, buckets: tuple[int, ...], max_pages: int, capture: bool) -> GraphedDraftChain:
        r = self.runner
        shape = ChainShape(
            tuple(buckets),
            max_pages,
            r.drafter.config.hidden_size,
            model_dtype(r.target),
            r.draft_window,
            DRAFT_KEY_START,
            r.manager.tokens_per_page,
            r.target.config.vocab_size,
            capture,
        )
        forward = lambda ids, hidden, rope, ctx: r.drafter.rotated(ids, hidden, rope, ctx, r.target)  # noqa: E731
        drafter = ChainDrafter(forward, r.drafter.rotary)
        head = ChainHead(r.draft_logits, r.draft_greedy())
        verify = ChainVerify(self.target, r.manager.tokens_per_page)
        return GraphedDraftChain(drafter, head, r.kv_pools.tensor(DRAFT_GROUP), shape, verify)

    def _batch(
        self,
        graphed: GraphedForward,
        spans: list[Span],
        hidden: torch.Tensor | None = None,
        tables: Sequence[torch.Tensor] | None = None,
    ) -> UniformBatch | None:
        """``tables``: the spans' rows (host) of each of ``graphed``'s layer groups, asked
        of the manager when None."""
        if (
            not spans
            or any(len(s.token_ids) != graphed.q_len for s in spans)
            or not graphed.fits(len(spans), graphed.q_len, 0)
        ):
            return None
        manager = self.runner.manager
        if tables is None:
            ids = [s.request_id for s in spans]
            tables = [manager.block_tables(ids, g.name) for g in graphed.groups]
        if any(t.shape[1] > graphed.max_pages for t in tables):
            return None
        return uniform_batch(spans, tables, manager.tokens_per_page, hidden)

    def _target_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: LayerContexts,
    ) -> tuple[torch.Tensor, ...]:
        r, q_len = self.runner, uniform_q_len(ctx)
        aux_ids = r.drafter.config.aux_layer_ids if r.drafter is not None else ()
        out = r.target(input_ids, positions, ctx, aux_ids)
        logits = r.target.head(out.hidden)  # [n, V] in the model's dtype
        best = argmax_rows(logits).view(-1, q_len)  # argmax of the float32 cast's too
        verdict = greedy_verdict(input_ids.view(-1, q_len), best, self.forced)  # [n, 3]
        states = (out.hidden,) if r.drafter is None else (out.hidden, r.drafter.project(out.aux))
        return *states, logits, verdict

    def _drafter_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: LayerContexts,
    ) -> tuple[torch.Tensor, ...]:
        return (self.runner.drafter(input_ids, hidden, positions, ctx.only(), self.runner.target),)


@torch.inference_mode()
def capture_decode_graphs(
    runner: ModelRunner, verify_len: int, max_batch: int, max_model_len: int, capture: bool = True
) -> DecodeGraphs:
    """The decode step's graphs over ``runner``'s models and pools, captured (``capture=False``:
    the same static-buffer path, run eagerly); the caller sets ``runner.graphs`` to them."""
    graphs = DecodeGraphs(runner, verify_len, max_batch, max_model_len, capture)
    graphs.capture()
    return graphs
