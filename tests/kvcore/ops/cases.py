"""Random paged-attention cases and a float64 dense attention to check them against.

Every page a case does not hold (spare pages, pages released out of the window) is
filled with NaN, and released pages are NULL in the block table: an op that reads one
returns NaN and fails the comparison.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kvcore.ops import AttentionParams, PagedBatch
from kvcore.ops.reference import to_pool_dtype
from kvcore.spec import NULL_PAGE, cdiv

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass(slots=True)
class Case:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    kv_pool: torch.Tensor  # [num_pages, num_layers, 2, num_kv_heads, P, head_dim]
    layer: int
    block_table: torch.Tensor  # [batch, max_pages] int32
    query_start_loc: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32
    scale: float
    window: int
    key_start: int = 0

    def to(self, device: str) -> Case:
        """The same case with every tensor on ``device``."""
        return dataclasses.replace(
            self,
            query=self.query.to(device),
            kv_pool=self.kv_pool.to(device),
            block_table=self.block_table.to(device),
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device),
        )

    def batch(self) -> PagedBatch:
        """The case's batch, varlen: its query starts and longest query."""
        q_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
        max_q_len = int(q_lens.max()) if q_lens.numel() else 0
        return PagedBatch(
            self.block_table, self.seq_lens, max_q_len, self.query_start_loc, self.window, self.key_start
        )

    def uniform_batch(self, q_len: int) -> PagedBatch:
        """The case's batch as decode (q_len 1) and verify take it: no query starts."""
        return PagedBatch(
            self.block_table, self.seq_lens, q_len, window=self.window, key_start=self.key_start
        )

    def params(self) -> AttentionParams:
        return AttentionParams(self.scale)

    def args(self) -> tuple:
        """(query, kv_pool, layer, batch, params): paged_attention's arguments."""
        return (self.query, self.kv_pool, self.layer, self.batch(), self.params())


def first_visible(seq_len: int, q_len: int, window: int) -> int:
    """Lowest key position any query of the sequence can see."""
    return max(0, seq_len - q_len - window + 1) if window else 0


def make_case(
    seq_lens: list[int],
    q_lens: list[int],
    *,
    tokens_per_page: int = 16,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    pool_dtype: torch.dtype = torch.bfloat16,
    query_dtype: torch.dtype = torch.bfloat16,
    window: int = 0,
    num_layers: int = 2,
    layer: int = 1,
    seed: int = 0,
    spare_pages: int = 3,
    device: str = "cpu",
    key_start: int = 0,
) -> Case:
    """Positions below ``key_start`` hold NaN too: they must never be read."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [cdiv(s, tokens_per_page) for s in seq_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    shape = (num_pages, num_layers, 2, num_kv_heads, tokens_per_page, head_dim)
    pool = to_pool_dtype(torch.randn(shape, generator=gen), pool_dtype)
    ids = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(pages_per_seq, default=0) + 1), NULL_PAGE, dtype=torch.int32)
    poisoned = ids[sum(pages_per_seq) :]
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        pages, ids = ids[: pages_per_seq[b]], ids[pages_per_seq[b] :]
        poisoned += place_pages(pool, table[b], pages, first_visible(seq_len, q_len, window), key_start)
    pool[poisoned] = to_pool_dtype(torch.full(shape[1:], math.nan), pool_dtype)
    query = torch.randn((sum(q_lens), num_q_heads, head_dim), generator=gen).to(query_dtype)
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return Case(query, pool, layer, table, starts, lens, head_dim**-0.5, window, key_start).to(device)


def place_pages(
    pool: torch.Tensor, row: torch.Tensor, pages: list[int], lo: int, key_start: int
) -> list[int]:
    """Write one sequence's ``pages`` into its block-table ``row`` in order, NULL for the
    pages wholly below key position ``lo`` (released: returned, to be poisoned), and NaN
    into the pool slots of key positions below ``key_start``."""
    size = pool.shape[4]  # tokens per page
    released = []
    for k, page in enumerate(pages):
        out_of_window = (k + 1) * size <= lo
        row[k] = NULL_PAGE if out_of_window else page
        if out_of_window:
            released.append(page)
        for pos in range(k * size, min(key_start, (k + 1) * size)):
            pool[page, :, :, :, pos % size] = math.nan
    return released


def dense_attention(case: Case) -> torch.Tensor:
    """float64 attention gathered position by position; never touches a key it must not."""
    pool = case.kv_pool.cpu()
    table = case.block_table.cpu()
    query = case.query.cpu().double()
    starts = case.query_start_loc.tolist()
    tokens_per_page = pool.shape[4]
    group = query.shape[1] // pool.shape[3]
    out = torch.zeros_like(query)
    for b, seq_len in enumerate(case.seq_lens.tolist()):
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = max(0, pos - case.window + 1) if case.window else 0
            lo = max(lo, case.key_start)
            if pos < lo:
                continue
            positions = torch.arange(lo, pos + 1)
            pages = table[b, positions // tokens_per_page].long()
            assert bool((pages != NULL_PAGE).all()), "a visible position has no page"
            kv = pool[pages, case.layer, :, :, positions % tokens_per_page].double()
            k = kv[:, 0].repeat_interleave(group, dim=1)  # [n, q_heads, hd]
            v = kv[:, 1].repeat_interleave(group, dim=1)
            q = query[starts[b] + i]  # [q_heads, hd]
            probs = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * case.scale, dim=-1)
            out[starts[b] + i] = torch.einsum("hn,nhd->hd", probs, v)
    return out


def assert_matches_dense(out: torch.Tensor, case: Case) -> None:
    ref = dense_attention(case)
    assert out.dtype == case.query.dtype and out.shape == case.query.shape
    tol = TOLERANCE[case.query.dtype]
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)
