"""The target's verify forward as the last stage of the draft chain's graph.

After the chain's K drafts, the target runs over [t_n, d_1, ..., d_K] at positions
n .. n + K of each request (the verify span of ``device_step.py``), writing its KV there,
then its head and the greedy verdict: the forward of the target's own verify graph (a
``GraphedForward`` over K + 1 tokens), into that graph's static outputs, where
``DecodeGraphs.verified`` reads the step's ``TargetRun``. Inside the chain's graph it needs
only each request's t_n and its target block-table rows: n is the chain's, the drafts are
the chain's ``out``; positions, slots and seq_lens follow on the device. A drafting step
then uploads and replays one graph for the catch-up, the chain and the verify.

Static layout: int32 ``[last (max_batch) | table (max_batch x max_pages)]``. Padding rows:
n = -1 (the chain's) and NULL table rows, so seq_len 0 and slots -1: they touch no page;
their positions are 0 .. K. Every request's KV is written from n on, so a request whose
target KV must not be written at n (``target_write_start`` > n) does not take this stage.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcore.ops import slots_at
from kvcore.spec import NULL_PAGE
from services.engine.graphed_forward import GraphedForward, UniformContext


class ChainVerify:
    """Static inputs of the verify stage of ``target``, the target's K + 1-token forward."""

    def __init__(self, target: GraphedForward, tokens_per_page: int) -> None:
        self.target, self.tokens_per_page = target, tokens_per_page
        mb, device = target.max_batch, target.kv_pool.device
        pinned = target.copied is not None
        self.host = torch.full(
            (mb * (1 + target.max_pages),), NULL_PAGE, dtype=torch.int32, pin_memory=pinned
        )
        self.host[:mb] = 0
        self.dev = self.host.to(device)
        self.offsets = torch.arange(target.q_len, device=device)  # [K + 1]
        self.row_ids = torch.arange(mb, device=device)[:, None]  # [max_batch, 1]
        self.copied = torch.cuda.Event() if pinned else None

    @property
    def k(self) -> int:
        return self.target.q_len - 1

    def fits(self, batch: int, width: int) -> bool:
        """Whether ``batch`` requests whose target tables are ``width`` pages wide fit."""
        return self.target.fits(batch, self.target.q_len, width)

    def load(self, last_tokens: list[int], table: np.ndarray, bucket: int) -> None:
        """Each request's t_n and target table rows ``table`` [batch, width] (which
        :meth:`fits`), padding rows NULL up to ``bucket``; then uploaded."""
        if self.copied is not None:
            self.copied.synchronize()  # the staging buffer is free again
        mb, pages, b, width = self.target.max_batch, self.target.max_pages, len(last_tokens), table.shape[1]
        host = self.host.numpy()
        host[:b] = last_tokens
        rows = host[mb : mb + bucket * pages].reshape(bucket, pages)
        rows[:b, :width] = table
        rows[:b, width:] = NULL_PAGE
        rows[b:] = NULL_PAGE
        used = mb + bucket * pages
        self.dev[:used].copy_(self.host[:used], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def run(self, bucket: int, n: torch.Tensor, drafts: torch.Tensor) -> None:
        """The target's forward over [t_n, drafts] into its static outputs' first
        bucket * (K + 1) rows; ``n`` [bucket] int64 (-1 on padding rows), ``drafts``
        [bucket, K] int64, both on the device."""
        target, mb, pages = self.target, self.target.max_batch, self.target.max_pages
        table = self.dev[mb : mb + bucket * pages].view(bucket, pages)
        positions = n.clamp(min=0)[:, None] + self.offsets  # [bucket, K + 1]
        slots = slots_at(table, self.row_ids[:bucket], positions, self.tokens_per_page)  # -1 on NULL rows
        seq_lens = ((n + target.q_len) * (n >= 0)).to(torch.int32)  # [bucket]
        ids = torch.cat([self.dev[:bucket, None].long(), drafts], dim=1)  # [bucket, K + 1]
        ctx = UniformContext(
            target.kv_pool, table, seq_lens, slots.reshape(-1), target.q_len, target.window, target.key_start
        )
        target.forward_into(ids.reshape(-1), positions.reshape(-1), None, ctx)
