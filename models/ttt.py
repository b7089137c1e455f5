"""Training-time test attention for the drafter: S chained draft steps in one pass.

At unroll step s the query at slot i stands for the s-th speculative slot of a chain whose
last exact slot is i - s. It sees the exact (step 0) keys at slots (i - W, i - s] and, for
r = 1..s, the key that step r computed at slot i - s + r: exactly what the chain drafter
sees at inference (window W; W = 0 means no lower bound). One drafter layer only: the
context keeps the keys of every step of layer 0.

Slot 0 (the first token with no target feature before it) is computed but is no key: the
published EAGLE-3 convention feeds no such row, and serving never attends it
(``DRAFT_KEY_START``). A query with no visible key (slot 0 at step 0) gets a finite
uniform row instead of NaN; the loss leaves it out.
"""

from __future__ import annotations

import torch

from kvcore.ops import AttentionParams
from services.engine.models.eagle import DRAFT_KEY_START


class ChainContext:
    def __init__(self, batch: int, seq_len: int, window: int) -> None:
        self.batch, self.seq_len, self.window = batch, seq_len, window
        self.keys: list[torch.Tensor] = []  # per step: [batch, kv_heads, seq_len, head_dim]
        self.values: list[torch.Tensor] = []

    @property
    def step(self) -> int:
        return len(self.keys)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams
    ) -> torch.Tensor:
        """q [batch * seq_len, heads, hd], k/v [batch * seq_len, kv_heads, hd]."""
        if layer != 0:
            raise ValueError("layer: chain training supports a one-layer drafter")
        scale = params.scale
        q4, k4, v4 = (self._heads_first(t) for t in (q, k, v))
        group = q4.shape[1] // k4.shape[1]
        s = self.step
        self.keys.append(k4)
        self.values.append(v4)
        k0 = self.keys[0].repeat_interleave(group, dim=1)  # [b, heads, T, hd]
        v0 = self.values[0].repeat_interleave(group, dim=1)
        scores = torch.matmul(q4, k0.transpose(-1, -2)).float() * scale  # [b, heads, T, T]
        scores = scores.masked_fill(~self._base_mask(s, q.device), torch.finfo(scores.dtype).min)
        diag_k = [self._shift(self.keys[r], s - r).repeat_interleave(group, dim=1) for r in range(1, s + 1)]
        diag = [(q4 * dk).sum(-1, keepdim=True).float() * scale for dk in diag_k]  # [b,h,T,1]
        probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
        out = torch.matmul(probs[..., : self.seq_len].to(v0.dtype), v0)
        for r in range(1, s + 1):
            dv = self._shift(self.values[r], s - r).repeat_interleave(group, dim=1)
            out = out + probs[..., self.seq_len + r - 1 : self.seq_len + r].to(dv.dtype) * dv
        return out.transpose(1, 2).reshape(q.shape)

    def _base_mask(self, s: int, device: torch.device) -> torch.Tensor:
        """[T, T] bool: query i sees exact key j iff max(i - W, 0) < j <= i - s."""
        i = torch.arange(self.seq_len, device=device)[:, None]
        j = torch.arange(self.seq_len, device=device)[None, :]
        mask = (j <= i - s) & (j >= DRAFT_KEY_START)
        if self.window > 0:
            mask &= j > i - self.window
        return mask

    def _heads_first(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.batch, self.seq_len, *t.shape[1:]).transpose(1, 2)

    @staticmethod
    def _shift(t: torch.Tensor, by: int) -> torch.Tensor:
        """Along the sequence axis (2): out[..., i, :] = t[..., i - by, :], zeros below."""
        if by == 0:
            return t
        return torch.nn.functional.pad(t, (0, 0, by, 0))[..., : t.shape[2], :]
