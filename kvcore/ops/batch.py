"""The values the attention and write ops take besides their query and pool.

- :class:`PagedBatch`: one forward's sequences as one layer group sees them (block table,
  lengths, query starts, the group's window and first key), built once per forward and
  read by every layer of the group;
- :class:`AttentionParams`: one layer's attention constants (scale; soft cap);
- :class:`RotaryWrite`: what a rotate-and-write needs per token (RoPE angle, slot).

A new attention parameter is a field of one of these, not an argument of every op.
Each value checks its own invariants once, when it is built; what relates it to a
query, a q/k/v or a pool is checked by each call (kvcore.ops.checks). Checks read shapes,
dtypes and devices only, never tensor values: building a value never synchronizes a
device, and is safe inside CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.ops.check_basics import check_index, fail


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """``batch`` sequences over one layer group's pages, as one forward attends them.

    Sequence b holds ``seq_lens[b]`` tokens, its queries included: its q_len_b queries are
    its last positions ``seq_lens[b] - q_len_b .. seq_lens[b] - 1``. Position t lives in page
    ``block_table[b, t // P]``, slot ``t % P``; entries past the context, and pages released
    out of the window, are NULL_PAGE and never read. A query at position p sees keys j with
    ``p - window < j <= p`` (no lower bound for window 0) and ``j >= key_start``.

    Invariants (checked at construction):
    - block_table [batch, max_pages], seq_lens [batch] and query_start_loc [batch + 1],
      int32 or int64, on one device;
    - query_start_loc None: a uniform batch, every sequence has exactly ``max_q_len``
      queries (decode: 1, verify: K + 1), and the GPU kernel reads no start table; else
      ``query_start_loc[b]`` is sequence b's first query token, and no sequence has more
      than ``max_q_len`` (the GPU kernel launches for that many and trusts it; the torch
      reference, which reads the lengths anyway, refuses a batch that breaks it);
    - window >= 0, key_start >= 0, max_q_len >= 0.
    """

    block_table: torch.Tensor  # [batch, max_pages] int32/int64, NULL_PAGE padded
    seq_lens: torch.Tensor  # [batch] int32/int64, tokens of each context, queries included
    max_q_len: int  # queries of the longest sequence; a uniform batch's q_len
    query_start_loc: torch.Tensor | None = None  # [batch + 1] cumulative query lengths, or None
    window: int = 0  # the group's sliding window in tokens; 0 = full attention
    key_start: int = 0  # keys below this position are never attended (EAGLE-3's unused slot)

    def __post_init__(self) -> None:
        check_paged_batch(self)

    @property
    def size(self) -> int:
        """Sequences in the batch."""
        return self.seq_lens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.block_table.device


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """One layer's attention constants: a query's score for a key is ``q . k * scale``
    before the softmax. ``softcap`` > 0 would cap each score to ``softcap * tanh(score /
    softcap)`` (Gemma 2's attention soft-capping); neither the reference nor the kernel
    implements it yet, so any value but 0 is refused at construction. ``sinks`` [num_q_heads]
    (this rank's heads) are learned logits, one per head, that join every row's softmax
    without a value (gpt-oss): a row's output is scaled by sum / (sum + exp(sink))."""

    scale: float  # usually head_dim ** -0.5
    softcap: float = 0.0  # 0 = no cap
    sinks: torch.Tensor | None = None  # [num_q_heads], any float dtype; None = no sinks

    def __post_init__(self) -> None:
        check_params(self)


@dataclass(frozen=True, slots=True)
class RotaryWrite:
    """Per token i of a merged q/k/v: the RoPE angle it is rotated by (rotate-half: pairs
    d, d + head_dim / 2; ``cos``/``sin`` hold the pair's value at both, halves repeating)
    and the slot its k and v go to (``page_id * P + offset``; -1: not written).

    Invariants (checked at construction): cos and sin float32 of one shape, num_tokens *
    head_dim elements (e.g. ``[num_tokens, 1, head_dim]``); slot_mapping [num_tokens]
    int32/int64; all on one device. Token counts and head_dim are checked per call."""

    cos: torch.Tensor  # [num_tokens, 1, head_dim] float32
    sin: torch.Tensor  # [num_tokens, 1, head_dim] float32
    slot_mapping: torch.Tensor  # [num_tokens] int32/int64, -1 = do not write

    def __post_init__(self) -> None:
        check_rotary_write(self)


def check_paged_batch(batch: PagedBatch) -> None:
    """A PagedBatch's own invariants (its docstring)."""
    device = batch.block_table.device
    check_index(batch.block_table, "block_table", 2, device)
    if batch.query_start_loc is not None:
        check_index(batch.query_start_loc, "query_start_loc", 1, device)
    check_index(batch.seq_lens, "seq_lens", 1, device)
    size = batch.seq_lens.shape[0]
    if batch.block_table.shape[0] != size:
        fail("block_table", f"has {batch.block_table.shape[0]} rows for batch {size}")
    starts = batch.query_start_loc
    if starts is not None and starts.shape[0] != size + 1:
        fail("query_start_loc", f"has {starts.shape[0]} entries, expected batch + 1 = {size + 1}")
    for name in ("window", "key_start", "max_q_len"):
        if getattr(batch, name) < 0:
            fail(name, f"must be >= 0, got {getattr(batch, name)}")


def check_params(params: AttentionParams) -> None:
    """What the ops implement of AttentionParams: no soft cap yet."""
    if params.softcap != 0:
        fail("softcap", f"attention logit soft-capping is not implemented, got {params.softcap}")


def check_rotary_write(write: RotaryWrite) -> None:
    """A RotaryWrite's own invariants (its docstring)."""
    for name, t in (("cos", write.cos), ("sin", write.sin)):
        if t.dtype != torch.float32:
            fail(name, f"expected float32, got {t.dtype}")
        if t.device != write.slot_mapping.device:
            fail(name, f"on {t.device}, slot_mapping on {write.slot_mapping.device}")
    check_index(write.slot_mapping, "slot_mapping", 1, write.slot_mapping.device)
