"""The routed (token, slot) pairs of an MoE layer sorted by expert, in blocks of one expert.

A slot id is ``token * k + slot``: the flat index into ``topk_ids`` [T, k]. ``align`` sorts
the S = T * k slot ids by expert (stable: ascending slot id within an expert) and pads each
expert's run up to a multiple of ``block_m`` with the id S (no slot), so that every block of
``block_m`` consecutive ids belongs to one expert. Blocks past the last expert's run are
whole padding and name the expert E (none): the grouped GEMMs skip them.

Every output size depends on (S, E, block_m) alone (``max_blocks``), never on the routing,
and no step reads a device value on the host: the function runs inside a CUDA graph
capture. Pure torch, so the CPU tests check it exactly; the Triton MoE kernels use it as is.

One token (a decode step of one request, the latency case) needs no sort: its k experts
are distinct, so the kernels give each slot b a block of its own, block b, of expert
topk_ids[0, b] (``one_token_blocks``: the same blocks as ``align``'s, in slot order), and
skip this function's dozen small kernels, about half of a one-token layer's GPU time.
"""

from __future__ import annotations

import torch


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the blocks any routing of ``num_slots`` slot ids needs: each
    expert with n > 0 ids takes ceil(n / block_m) <= n // block_m + 1 blocks, so the sum is
    at most S // block_m + min(S, E); also at most (S + E * (block_m - 1)) / block_m."""
    loose = -(-(num_slots + num_experts * (block_m - 1)) // block_m)
    return min(loose, num_slots // block_m + min(num_slots, num_experts))


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int (each in [0, E)) -> (sorted_ids [B * block_m] int32, block_expert
    [B] int32) with B = ``max_blocks(T * k, E, block_m)``.

    sorted_ids: the slot ids grouped by ascending expert, ascending within an expert, each
    expert's run padded with S = T * k to a multiple of block_m, then S to the end.
    block_expert[b]: the expert of sorted_ids[b * block_m : (b + 1) * block_m], or E for a
    block of padding alone."""
    flat = topk_ids.reshape(-1).to(torch.int64)  # [S]
    num_slots, device = flat.numel(), flat.device
    blocks = max_blocks(num_slots, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] ids per expert
    padded = (counts + block_m - 1) // block_m * block_m  # [E] each run's padded length
    padded_end = padded.cumsum(0)  # [E] where each expert's padded run ends
    order = torch.argsort(flat, stable=True)  # [S] slot ids by expert, ascending within one
    experts = flat[order]  # [S]
    rank = torch.arange(num_slots, device=device) - (counts.cumsum(0) - counts)[experts]  # [S]
    position = (padded_end - padded)[experts] + rank  # [S] distinct positions in sorted_ids
    sorted_ids = torch.full((blocks * block_m,), num_slots, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, position, order.to(torch.int32))
    starts = torch.arange(blocks, dtype=torch.int64, device=device) * block_m  # [B]
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)  # [B]
    return sorted_ids, block_expert


def one_token_blocks(topk_ids: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [1, k] of distinct experts -> (sorted_ids [k * block_m], block_expert [k])
    int32 as the kernels' one-token mode reads them without a tensor: block b holds slot b
    alone (then the padding id k), of expert topk_ids[0, b]."""
    k = topk_ids.shape[1]
    ids = torch.full((k, block_m), k, dtype=torch.int32, device=topk_ids.device)
    ids[:, 0] = torch.arange(k, dtype=torch.int32, device=topk_ids.device)
    return ids.reshape(-1), topk_ids.reshape(-1).to(torch.int32)
