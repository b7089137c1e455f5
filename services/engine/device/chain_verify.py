"""The target's verify forward as the last stage of the draft chain's graph.

After the chain's K drafts, the target runs over [t_n, d_1, ..., d_K] at positions
n .. n + K of each request (the verify span of ``device_step.py``), writing its KV there,
then its head and the greedy verdict: the forward of the target's own verify graph (a
``GraphedForward`` over K + 1 tokens), into that graph's static outputs, where
``DecodeGraphs.verified`` reads the step's ``TargetRun``. Inside the chain's graph it needs
only each request's t_n and its block-table rows of each of the target's layer groups: n is
the chain's, the drafts are the chain's ``out``; positions, slots and seq_lens follow on the
device. A drafting step then uploads and replays one graph for the catch-up, the chain and
the verify.

Static layout, with G target groups: int32 ``[last (max_batch) | table of group 0
(max_batch x max_pages) | ... | of group G - 1]``. Padding rows:
n = -1 (the chain's) and NULL table rows, so seq_len 0 and slots -1: they touch no page;
their positions are 0 .. K. Every request's KV is written from n on, so a request whose
target KV must not be written at n (``target_write_start`` > n) does not take this stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvcore.ops import slots_at
from kvcore.spec import NULL_PAGE
from services.engine.device.graphed_forward import GraphedForward, table_rows, uniform_context
from services.engine.models import layer_contexts


class ChainVerify:
    """Static inputs of the verify stage of ``target``, the target's K + 1-token forward."""

    def __init__(self, target: GraphedForward, tokens_per_page: int) -> None:
        self.target, self.tokens_per_page = target, tokens_per_page
        mb, device, self.num_groups = target.max_batch, target.device, len(target.groups)
        pinned = target.copied is not None
        self.host = torch.full(
            (mb * (1 + self.num_groups * target.max_pages),), NULL_PAGE, dtype=torch.int32, pin_memory=pinned
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

    def load(self, last_tokens: list[int], tables: Sequence[np.ndarray], bucket: int) -> None:
        """Each request's t_n and its rows [batch, width] of each target group's table
        (which :meth:`fits`), padding rows NULL up to ``bucket``; then uploaded."""
        if self.copied is not None:
            self.copied.synchronize()  # the staging buffer is free again
        b, host = len(last_tokens), self.host.numpy()
        host[:b] = last_tokens
        for g, table in enumerate(tables):
            rows = self._table(host, bucket, g)
            rows[:b, : table.shape[1]] = table
            rows[:b, table.shape[1] :] = NULL_PAGE
            rows[b:] = NULL_PAGE
        used = self.target.max_batch * (1 + (self.num_groups - 1) * self.target.max_pages)
        used += bucket * self.target.max_pages
        self.dev[:used].copy_(self.host[:used], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def run(self, bucket: int, n: torch.Tensor, drafts: torch.Tensor) -> None:
        """The target's forward over [t_n, drafts] into its static outputs' first
        bucket * (K + 1) rows; ``n`` [bucket] int64 (-1 on padding rows), ``drafts``
        [bucket, K] int64, both on the device."""
        target = self.target
        positions = n.clamp(min=0)[:, None] + self.offsets  # [bucket, K + 1]
        seq_lens = ((n + target.q_len) * (n >= 0)).to(torch.int32)  # [bucket]
        ids = torch.cat([self.dev[:bucket, None].long(), drafts], dim=1)  # [bucket, K + 1]
        contexts = []
        for g, group in enumerate(target.groups):
            table = self._table(self.dev, bucket, g)
            slots = slots_at(table, self.row_ids[:bucket], positions, self.tokens_per_page)  # -1 on NULL rows
            contexts.append(uniform_context(group, table, seq_lens, slots.reshape(-1), target.q_len))
        ctx = layer_contexts(target.groups, contexts)
        target.forward_into(ids.reshape(-1), positions.reshape(-1), None, ctx)

    def _table(self, buffer, bucket: int, group: int):
        """[bucket, max_pages] view of ``group``'s rows in the staging buffer or its copy."""
        return table_rows(buffer, self.target.max_batch, self.target.max_pages, bucket, group)
