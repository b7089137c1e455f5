"""The drafter's catch-up forward as the first stage of the draft chain's graph.

A drafting step first runs the drafter over each request's pending slots [pending_start,
n] (the tokens the last step emitted, at most L = K + 1) with their target features; its
output at slot n, g_n, starts the chain. Inside the chain's graph this is one more forward
over exactly L tokens per request: each span is widened at the front, as
``cuda_graphs.pad_front`` does (the added positions write no KV, read only exact KV below
them, and their outputs are dropped), so g_n is the last of each request's L rows. A step
then uploads and replays one graph for both.

Static layout: int64 ``[ids | positions | slots | rows]``, each ``[max_batch * L]``, then
``seq_lens`` [max_batch]; ``hidden`` [max_batch * L, hidden_size]. ``rows``: where each
pending feature goes in ``hidden`` (the first num_pending are used, request by request).
Padding requests: seq_len 0 and slots -1, so they touch no page.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcore.ops import uniform_slots


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
        self.host = torch.zeros(4 * self.tokens + self.max_batch, dtype=torch.int64, pin_memory=pinned)
        self.host[2 * self.tokens : 3 * self.tokens] = -1  # slots: write nothing
        self.dev = self.host.to(device)
        self.copied = torch.cuda.Event() if pinned else None

    def fits(self, pending: PendingSpans) -> bool:
        return pad_fits(pending.starts, [len(t) for t in pending.tokens], self.q_len)

    def load(self, pending: PendingSpans, table: np.ndarray, bucket: int, tokens_per_page: int) -> None:
        """Fill the stage's inputs for ``pending`` (which :meth:`fits`) over host block-table
        rows ``table`` [batch, width], padding requests up to ``bucket``; then the pending
        features go to their rows of ``hidden`` (stream order, after the upload)."""
        if self.copied is not None:
            self.copied.synchronize()  # the staging buffer is free again
        L, t, b = self.q_len, self.tokens, len(pending.starts)
        host = self.host.numpy()
        ids, positions, slots = (host[i * t : (i + 1) * t].reshape(self.max_batch, L) for i in range(3))
        starts = np.asarray(pending.starts, dtype=np.int64)
        lens = np.fromiter(map(len, pending.tokens), np.int64, b)
        pad = L - lens
        padded = starts - pad  # [batch]: each span widened to L tokens
        real = np.arange(L)[None, :] >= pad[:, None]  # [batch, L]
        ids[:bucket] = 0
        ids[:b][real] = [tok for span in pending.tokens for tok in span]
        pos = padded[:, None] + np.arange(L)  # [batch, L]
        positions[:b], positions[b:bucket] = pos, 0
        at = uniform_slots(table, padded, L, tokens_per_page)
        slots[:b], slots[b:bucket] = np.where(real, at, -1), -1
        rows = np.flatnonzero(real)  # [num_pending], request by request
        host[3 * t : 3 * t + rows.shape[0]] = rows
        seq_lens = host[4 * t :]
        seq_lens[:b], seq_lens[b:bucket] = starts + lens, 0
        self.dev.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.hidden.index_copy_(0, self.dev[3 * t : 3 * t + rows.shape[0]], pending.features)

    def inputs(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions, slots [bucket * L] int64, seq_lens [bucket] int32, hidden
        [bucket * L, hidden_size]) over the static buffers: what the graph reads."""
        n, t = bucket * self.q_len, self.tokens
        seq_lens = self.dev[4 * t : 4 * t + bucket].to(torch.int32)
        return self.dev[:n], self.dev[t : t + n], self.dev[2 * t : 2 * t + n], seq_lens, self.hidden[:n]
