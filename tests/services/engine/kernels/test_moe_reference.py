"""The MoE reference (``reference.moe_experts``) against a dense per-expert loop, exactly, and
the expert sort the Triton kernel runs on (``moe_align.align``), exactly.

The dense loop computes every expert on every token and weights it by a dense [T, E]
routing matrix (zero where a token does not route to an expert), rounding as the reference
rounds: each linear's output, each activation step and each weighted product in x's dtype,
the sum over experts in float32 in ascending expert order (the reference's order), then x's
dtype. An unrouted expert adds a float32 zero, which changes no sum.

Its matmuls run over all T rows, the reference's over the routed rows, and a CPU matmul
may round a row differently by batch size. So the experts are drawn such that no matmul
rounds by order: x, w13 and b13 are small multiples of 1/4 and 1/8 (H = 16), so every
gate/up value is exact in bf16; each row of w2 has one nonzero, a power of two, so w2 @ act
is one exact product and b2 adds one rounding. The activations, routing weights and
products stay arbitrary: every rounding the reference defines is exercised. I is a multiple
of 32 so that torch's CPU elementwise ops over [n, I] never reach their scalar tail loop,
which may round exp and sigmoid differently from the vector loop in float32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.kernels import reference
from services.engine.kernels.moe_align import align, max_blocks, one_token_blocks
from services.engine.kernels.reference import Experts

HIDDEN = 16  # sum of 16 products of |x| <= 1 and |w| <= 1/2 in steps of 1/16: exact in bf16


def random_experts(dims: tuple[int, int], dtype: torch.dtype, gpt_oss: bool, seed: int) -> Experts:
    """dims (E, I): random experts of hidden size HIDDEN whose matmuls are exact (module
    docstring); gpt-oss style adds biases and the clamped SwiGLU (limit 1.5, often hit)."""
    e, i = dims
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randint(-2, 3, (e, 2 * i, HIDDEN), generator=g) / 4
    w2 = torch.zeros(e, HIDDEN, i)
    column = torch.randint(0, i, (e, HIDDEN, 1), generator=g)
    power = 2.0 ** -torch.randint(0, 4, (e, HIDDEN, 1), generator=g)
    sign = torch.randint(0, 2, (e, HIDDEN, 1), generator=g) * 2 - 1
    w2.scatter_(2, column, sign * power)
    if not gpt_oss:
        return Experts(w13.to(dtype), w2.to(dtype))
    b13 = torch.randint(-8, 9, (e, 2 * i), generator=g) / 8
    b2 = torch.randint(-8, 9, (e, HIDDEN), generator=g) / 8
    return Experts(
        w13.to(dtype), w2.to(dtype), b13.to(dtype), b2.to(dtype), activation="clamped_swiglu", limit=1.5
    )


def random_x(num_tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """x [T, HIDDEN]: multiples of 1/4 in [-1, 1]."""
    return (torch.randint(-4, 5, (num_tokens, HIDDEN), generator=torch.Generator().manual_seed(seed)) / 4).to(
        dtype
    )


def random_routing(
    num_tokens: int, num_experts: int, top_k: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] distinct per row, topk_weights [T, k] float32 renormalised."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=-1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True)


def dense_moe(
    x: torch.Tensor, experts: Experts, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Every expert on every token, weighted by the dense routing matrix."""
    num_experts = experts.w13.shape[0]
    routing = torch.zeros(x.shape[0], num_experts, dtype=x.dtype)  # [T, E]
    routing.scatter_(1, topk_ids.long(), topk_weights.to(x.dtype))
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(num_experts):
        b13 = None if experts.b13 is None else experts.b13[e]
        b2 = None if experts.b2 is None else experts.b2[e]
        h = F.linear(x, experts.w13[e], b13)  # [T, 2I]
        act = reference.expert_activation(h, experts.activation, experts.limit)  # [T, I]
        y = F.linear(act, experts.w2[e], b2)  # [T, H]
        out += (y * routing[:, e, None]).float()
    return out.to(x.dtype)


CASES = [  # (T, E, k, I)
    (0, 4, 2, 32),
    (1, 4, 2, 32),
    (1, 8, 8, 64),
    (37, 8, 2, 32),
    (200, 16, 4, 64),
]


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "clamped_swiglu-biases"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-E{c[1]}-k{c[2]}" for c in CASES])
def test_reference_equals_the_dense_loop_exactly(case, dtype, gpt_oss):
    t, e, k, i = case
    experts = random_experts((e, i), dtype, gpt_oss, seed=t + e)
    x = random_x(t, dtype, seed=t)
    ids, weights = random_routing(t, e, k, seed=t * 7 + k)
    out = reference.moe_experts(x, experts, ids, weights)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(out, dense_moe(x, experts, ids, weights))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_tied_routing_weights_and_every_token_on_one_expert(dtype):
    e, k, t = 6, 3, 25
    experts = random_experts((e, 32), dtype, gpt_oss=True, seed=3)
    x = random_x(t, dtype, seed=4)
    ids = torch.stack([torch.tensor([2, r % 4 + (r % 4 >= 2), 5]) for r in range(t)])
    assert all(len(set(row.tolist())) == k for row in ids)
    weights = torch.full((t, k), 1 / 3)  # ties everywhere; expert 2 in every row
    weights[::4] = torch.tensor([0.25, 0.5, 0.25])
    out = reference.moe_experts(x, experts, ids, weights)
    assert torch.equal(out, dense_moe(x, experts, ids, weights))


def test_the_reference_refuses_an_unknown_activation():
    experts = random_experts((2, 32), torch.float32, gpt_oss=False, seed=0)
    ids, weights = random_routing(3, 2, 1, seed=0)
    with pytest.raises(ValueError, match="gelu"):
        reference.moe_experts(
            random_x(3, torch.float32, 0), Experts(experts.w13, experts.w2, activation="gelu"), ids, weights
        )


# align: the expert sort


def test_align_on_a_small_routing():
    ids = torch.tensor([[2, 0], [0, 3], [2, 1]])  # slot ids 0..5: token * 2 + slot
    sorted_ids, block_expert = align(ids, num_experts=5, block_m=4)
    pad = 6
    runs = [1, 2, pad, pad, 5, pad, pad, pad, 0, 4, pad, pad, 3, pad, pad, pad]  # experts 0, 1, 2, 3
    assert sorted_ids.tolist() == runs + [pad] * 8  # 6 blocks: the bound for 6 slots of 5 experts
    assert block_expert.tolist() == [0, 1, 2, 3, 5, 5]
    assert sorted_ids.dtype == torch.int32 and block_expert.dtype == torch.int32
    assert len(sorted_ids) == 4 * len(block_expert) == 4 * max_blocks(6, 5, 4)


def test_align_of_a_full_block_and_of_one_token():
    ids = torch.tensor([[1], [1], [1], [1], [0]])
    sorted_ids, block_expert = align(ids, num_experts=2, block_m=2)
    assert sorted_ids.tolist()[:6] == [4, 5, 0, 1, 2, 3]
    assert block_expert.tolist()[:3] == [0, 1, 1]
    one, experts = align(torch.tensor([[7, 3, 5]]), num_experts=8, block_m=16)
    assert len(experts) == 3 and experts.tolist() == [3, 5, 7]  # 3 blocks, not E * 15 rows
    assert one.view(3, 16)[:, 0].tolist() == [1, 2, 0] and (one.view(3, 16)[:, 1:] == 3).all()


@pytest.mark.parametrize(
    "t, e, k, block_m", [(1, 128, 8, 16), (37, 8, 2, 16), (300, 16, 4, 64), (64, 4, 4, 16)]
)
def test_align_properties_on_random_routing(t, e, k, block_m):
    ids, _ = random_routing(t, e, k, seed=t)
    sorted_ids, block_expert = align(ids, e, block_m)
    slots = t * k
    assert (
        len(block_expert) == max_blocks(slots, e, block_m) and len(sorted_ids) == len(block_expert) * block_m
    )
    assert len(sorted_ids) <= slots + e * (block_m - 1) + block_m - 1
    flat = ids.reshape(-1)
    real = sorted_ids[sorted_ids < slots].long()
    assert sorted(real.tolist()) == list(range(slots))  # each slot once
    assert (sorted_ids <= slots).all()
    for b, expert in enumerate(block_expert.tolist()):
        block = sorted_ids[b * block_m : (b + 1) * block_m].long()
        inside = block[block < slots]
        if expert == e:
            assert len(inside) == 0
            continue
        assert len(inside) > 0 and (flat[inside] == expert).all()
        assert inside.tolist() == sorted(inside.tolist())
        assert (block[len(inside) :] == slots).all()  # padding only after a run's ids
    used = block_expert[block_expert < e]
    assert (used[1:] >= used[:-1]).all()  # blocks by ascending expert
    assert (block_expert[len(used) :] == e).all()  # padding blocks at the end
    counts = torch.bincount(flat, minlength=e)
    assert torch.equal(torch.bincount(used.long(), minlength=e), (counts + block_m - 1) // block_m)


def test_one_token_takes_a_block_per_slot_without_a_sort():
    ids = torch.tensor([[7, 3, 5]])
    sorted_ids, block_expert = one_token_blocks(ids, block_m=4)
    assert sorted_ids.tolist() == [0, 3, 3, 3, 1, 3, 3, 3, 2, 3, 3, 3]  # slot b alone in block b
    assert block_expert.tolist() == [7, 3, 5]
    assert sorted_ids.dtype == torch.int32 and block_expert.dtype == torch.int32
    # the same blocks as the sort's, in slot order instead of expert order
    blocks, experts = align(ids, num_experts=8, block_m=4)
    pairs = lambda s, e: sorted(zip(e.tolist(), s.view(-1, 4).tolist(), strict=True))  # noqa: E731
    assert pairs(sorted_ids, block_expert) == pairs(blocks, experts)


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "clamped_swiglu-biases"])
def test_one_token_through_the_kernels_data_flow_equals_the_sorted_one(gpt_oss):
    """Bitwise: each slot's product is computed alone and the k are summed in slot order,
    whichever order the blocks come in."""
    experts = random_experts((8, 12), torch.bfloat16, gpt_oss, seed=4)
    ids, weights = random_routing(1, 8, 3, seed=4)
    x = random_x(1, torch.bfloat16, 4)
    out = sorted_moe(x, experts, ids, weights, one_token_blocks(ids, block_m=4))
    assert torch.equal(out, sorted_moe(x, experts, ids, weights))


def test_max_blocks_is_tight_for_one_slot_per_expert_and_for_full_blocks():
    assert max_blocks(8, 128, 16) == 8  # decode: one block per touched expert
    assert max_blocks(0, 8, 16) == 0
    assert max_blocks(64, 4, 16) == 4 + 4  # 4 full blocks, and up to one partial per expert
    for slots, e, m in [(16384, 128, 16), (1024, 8, 128), (5, 3, 4)]:
        assert max_blocks(slots, e, m) * m <= slots + e * (m - 1) + m - 1


def sorted_moe(
    x: torch.Tensor,
    experts: Experts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The Triton kernel's data flow in torch, block by block over ``align``'s output (or
    ``blocks``, another (sorted_ids, block_expert) of 4 rows a block): gather the block's
    token rows, both linears and the activation, times the slot's weight, stored at row
    token * k + slot, then each token's k rows summed in slot order."""
    t, k = topk_ids.shape
    e_count, block_m = experts.w13.shape[0], 4
    sorted_ids, block_expert = blocks or align(topk_ids, e_count, block_m)
    weights = topk_weights.to(x.dtype).reshape(-1)
    slots = torch.full((t * k, x.shape[1]), float("nan"), dtype=x.dtype)
    for b, e in enumerate(block_expert.tolist()):
        ids = sorted_ids[b * block_m : (b + 1) * block_m].long()
        ids = ids[ids < t * k]
        if e == e_count:
            assert len(ids) == 0
            continue
        b13 = None if experts.b13 is None else experts.b13[e]
        b2 = None if experts.b2 is None else experts.b2[e]
        act = reference.expert_activation(
            F.linear(x[ids // k], experts.w13[e], b13), experts.activation, experts.limit
        )
        slots[ids] = F.linear(act, experts.w2[e], b2) * weights[ids, None]
    return slots.view(t, k, x.shape[1]).float().sum(1).to(x.dtype)


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "clamped_swiglu-biases"])
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-E{c[1]}-k{c[2]}" for c in CASES])
def test_the_kernels_data_flow_over_align_matches_the_reference(case, gpt_oss):
    """Equal but for the float32 sum's order (slot order against expert order): at most one
    bf16 ulp of the output scale."""
    t, e, k, i = case
    experts = random_experts((e, i), torch.bfloat16, gpt_oss, seed=t + e)
    x = random_x(t, torch.bfloat16, seed=t)
    ids, weights = random_routing(t, e, k, seed=t * 7 + k)
    out, ref = sorted_moe(x, experts, ids, weights), reference.moe_experts(x, experts, ids, weights)
    assert out.shape == ref.shape and not out.isnan().any()
    if t:
        assert float((out.float() - ref.float()).abs().max()) <= 2**-7 * float(ref.float().abs().max())
