"""The drafter's catch-up forward as the first stage of the draft chain's graph.

A drafting step first runs the drafter over each request's pending slots [pending_start,
n] (the tokens the last step emitted, at most L = K + 1) with their target features; its
output at slot n, g_n, starts the chain. Inside the chain's graph this is one more forward
over exactly L tokens per request: each span is widened at the front, as
``cuda_graphs.pad_front`` does (the added positions write no KV, read only exact KV below
them, and their outputs are dropped), so g_n is the last of each request's L rows. A step
then uploads and replays one graph for both.

Static layout: int64 ``[ids | rows]``, each ``[max_batch * L]``, then ``[padded | pad]``,
each ``[max_batch]``: each widened span's first position and how many of its L rows widen
it; ``hidden`` [max_batch * L, hidden_size]. ``rows``: where each pending feature goes in
``hidden`` (the first num_pending are used, request by request). Positions, slots and
seq_lens follow on the device from these and the chain's block table (:meth:`inputs`).
Padding requests: pad = L, so seq_len 0 and slots -1: they touch no page.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcore.ops import slots_at


@dataclass(frozen=True, slots=True)
class PendingSpans:
    """Each request's pending slots: its first position and tokens (the last at slot n),
    and their target features [num_pending, hidden_size] on the device, request by request."""

    starts: list[int]
    tokens: list[list[int]]
    features: torch.Tensor


def pad_fits(starts: list[int], lens: list[int], q_len: int) -> bool:
    """Whether every span of ``lens[i]`` tokens from ``starts[i]`` widens to ``q_len`` at the
    front: not longer, and not so near position 0 that it would start before it."""
    return all(n <= q_len and s >= q_len - n for s, n in zip(starts, lens, strict=True))


class ChainCatchUp:
    """Static inputs of the chain's catch-up stage over L = ``q_len`` tokens per request."""

    def __init__(self, q_len: int, hidden: torch.Tensor, pinned: bool) -> None:
        """``hidden`` [max_batch * q_len, hidden_size]: the stage's input buffer, on the
        chain's device; ``pinned``: stage the host inputs in pinned memory."""
        self.q_len, self.tokens, self.hidden = q_len, hidden.shape[0], hidden
        self.max_batch, device = self.tokens // q_len, hidden.device
        self.host = torch.zeros(2 * self.tokens + 2 * self.max_batch, dtype=torch.int64, pin_memory=pinned)
        self.host[2 * self.tokens + self.max_batch :] = q_len  # pad: every request padding
        self.dev = self.host.to(device)
        self.offsets = torch.arange(q_len, device=device)  # [L]
        self.row_ids = torch.arange(self.max_batch, device=device)[:, None]  # [max_batch, 1]
        self.copied = torch.cuda.Event() if pinned else None

    def fits(self, pending: PendingSpans) -> bool:
        return pad_fits(pending.starts, [len(t) for t in pending.tokens], self.q_len)

    def load(self, pending: PendingSpans, bucket: int) -> None:
        """Fill the stage's inputs for ``pending`` (which :meth:`fits`), padding requests up
        to ``bucket``; then the pending features go to their rows of ``hidden`` (stream
        order, after the upload)."""
        if self.copied is not None:
            self.copied.synchronize()  # the staging buffer is free again
        L, t, mb, b = self.q_len, self.tokens, self.max_batch, len(pending.starts)
        host = self.host.numpy()
        ids = host[:t].reshape(mb, L)
        lens = np.fromiter(map(len, pending.tokens), np.int64, b)
        pad = L - lens
        real = np.arange(L)[None, :] >= pad[:, None]  # [batch, L]
        ids[:bucket] = 0
        ids[:b][real] = [tok for span in pending.tokens for tok in span]
        rows = np.flatnonzero(real)  # [num_pending], request by request
        host[t : t + rows.shape[0]] = rows
        padded, pads = host[2 * t : 2 * t + mb], host[2 * t + mb :]
        padded[:b], padded[b:bucket] = np.asarray(pending.starts, dtype=np.int64) - pad, 0
        pads[:b], pads[b:bucket] = pad, L
        self.dev.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.hidden.index_copy_(0, self.dev[t : t + rows.shape[0]], pending.features)

    def load_device(
        self, ids: torch.Tensor, padded: torch.Tensor, hidden: torch.Tensor, bucket: int | None
    ) -> None:
        """The first m rows' inputs from the device, for a step launched before its
        predecessor was read (``spec_overlap.py``): ``ids`` [m, L] int64 (each widened
        span's tokens, 0 in its front padding), ``padded`` [m, 2] int64 (each span's first
        position and its padding rows), ``hidden`` [m * L, hidden_size]. ``bucket``: rows
        m .. bucket - 1 made padding; None: they were loaded (:meth:`load`) and stay."""
        L, t, mb, m = self.q_len, self.tokens, self.max_batch, ids.shape[0]
        rows = self.dev[:t].view(mb, L)
        first, pad = self.dev[2 * t : 2 * t + mb], self.dev[2 * t + mb :]
        rows[:m], first[:m], pad[:m] = ids, padded[:, 0], padded[:, 1]
        if bucket is not None:
            rows[m:bucket], first[m:bucket], pad[m:bucket] = 0, 0, L
        self.hidden[: m * L].copy_(hidden)

    def inputs(self, bucket: int, table: torch.Tensor, tokens_per_page: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions, slots [bucket * L] int64, seq_lens [bucket] int32, hidden
        [bucket * L, hidden_size]): what the graph reads, derived on the device from the
        static buffers and the requests' block-table rows ``table`` [bucket, max_pages]."""
        L, t, mb, n = self.q_len, self.tokens, self.max_batch, bucket * self.q_len
        padded = self.dev[2 * t : 2 * t + bucket]  # [bucket]
        pad = self.dev[2 * t + mb : 2 * t + mb + bucket]  # [bucket]
        positions = padded[:, None] + self.offsets  # [bucket, L]
        real = self.offsets >= pad[:, None]  # [bucket, L]: the request's own rows
        slots = real * (slots_at(table, self.row_ids[:bucket], positions, tokens_per_page) + 1) - 1
        seq_lens = ((padded + L) * (pad < L)).to(torch.int32)
        return self.dev[:n], positions.reshape(-1), slots.reshape(-1), seq_lens, self.hidden[:n]
