"""The fused Triton MoE kernel against the torch reference (``reference.moe_experts``) at the
expert shapes of Qwen3-30B-A3B, Mixtral-8x7B (intermediate scaled down to 3584) and
gpt-oss-20b (biases, clamped SwiGLU), on random bf16 inputs and routing.

Tolerance: both sides round the same intermediates to bf16 (each linear's output, each
activation step, each weighted product) and sum the k products in float32, so they differ
only by float32 accumulation order inside the two matmuls. That moves an intermediate by at
most one bf16 ulp where it lies near a rounding boundary, and the k products and the final
rounding can each carry such a step: we allow 2 bf16 ulps of the output scale (its largest
magnitude) per element, and a relative norm error under 2**-8 (bf16 operands land between
1e-3 and 1e-2 only when the rounding is not mirrored; here it is).
"""

import pytest
import torch

from services.engine.kernels import reference
from services.engine.kernels.reference import Experts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_ULP = 2**-7
SHAPES = {  # name: (experts, top k, hidden, intermediate, gpt-oss style)
    "qwen3-30b-a3b": (128, 8, 2048, 768, False),
    "mixtral-8x7b-small": (8, 2, 4096, 3584, False),
    "gpt-oss-20b": (32, 4, 2880, 2880, True),
}


def triton_moe():
    from services.engine.kernels import triton_moe

    return triton_moe


def make_experts(shape: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Experts:
    """Random experts whose linears keep unit-scale activations."""
    e, _, h, i, gpt_oss = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) * i**-0.5).to(dtype)
    if not gpt_oss:
        return Experts(w13, w2)
    b13 = (0.5 * torch.randn(e, 2 * i, device="cuda", generator=g)).to(dtype)
    b2 = (0.5 * torch.randn(e, h, device="cuda", generator=g)).to(dtype)
    return Experts(w13, w2, b13, b2, activation="clamped_swiglu", limit=7.0)


def make_inputs(
    shape: str, num_tokens: int, dtype: torch.dtype = torch.bfloat16, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] (scaled so gpt-oss's clamp is reached), topk_ids [T, k], topk_weights [T, k]
    float32 as a softmax router gives them."""
    e, k, h, _, gpt_oss = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = ((3.0 if gpt_oss else 1.0) * torch.randn(num_tokens, h, device="cuda", generator=g)).to(dtype)
    logits = torch.randn(num_tokens, e, device="cuda", generator=g)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    return x, ids, weights / weights.sum(-1, keepdim=True)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if ref.numel() == 0:
        return
    diff = (out.float() - ref.float()).abs()
    scale = ref.float().abs().max()
    assert not out.isnan().any()
    assert float(diff.max()) <= 2 * BF16_ULP * float(scale), (float(diff.max()), float(scale))
    assert float(diff.norm() / ref.float().norm()) < 2**-8


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512, 0])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_reference(shape, num_tokens):
    experts = make_experts(shape)
    x, ids, weights = make_inputs(shape, num_tokens, seed=num_tokens)
    out = triton_moe().moe_experts(x, experts, ids, weights)
    assert_close(out, reference.moe_experts(x, experts, ids, weights))


@pytest.mark.parametrize("tiles", ["DECODE", "MIDDLE", "PREFILL"])
@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_every_tile_choice_matches_reference(shape, tiles):
    moe = triton_moe()
    experts = make_experts(shape)
    x, ids, weights = make_inputs(shape, 300, seed=3)
    out = moe.moe_experts_tiled(x, experts, ids, weights, getattr(moe, tiles))
    assert_close(out, reference.moe_experts(x, experts, ids, weights))


def test_float16_and_the_dispatch_take_the_kernel():
    from services.engine import kernels

    experts = make_experts("gpt-oss-20b", dtype=torch.float16)
    x, ids, weights = make_inputs("gpt-oss-20b", 33, dtype=torch.float16)
    out = kernels.moe_experts(x, experts, ids, weights)
    assert torch.equal(out, triton_moe().moe_experts(x, experts, ids, weights))
    assert_close(out, reference.moe_experts(x, experts, ids, weights))


def test_repeated_calls_are_bitwise_equal():
    experts = make_experts("qwen3-30b-a3b")
    x, ids, weights = make_inputs("qwen3-30b-a3b", 512)
    first = triton_moe().moe_experts(x, experts, ids, weights)
    assert torch.equal(first, triton_moe().moe_experts(x, experts, ids, weights))


@pytest.mark.parametrize("num_tokens", [1, 64])
@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_graph_replay_with_new_inputs_equals_eager(shape, num_tokens):
    moe = triton_moe()
    experts = make_experts(shape)
    x, ids, weights = make_inputs(shape, num_tokens, seed=5)
    moe.moe_experts(x, experts, ids, weights)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe_experts(x, experts, ids, weights)
    for seed in (6, 7):
        new_x, new_ids, new_weights = make_inputs(shape, num_tokens, seed=seed)
        x.copy_(new_x)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        eager = moe.moe_experts(new_x, experts, new_ids, new_weights)
        assert torch.equal(out, eager)
        assert_close(out, reference.moe_experts(new_x, experts, new_ids, new_weights))
