"""The decoder's Triton kernels against their torch reference, on random bf16 inputs.

Tolerances: one bf16 ulp of the output scale (the kernels reduce in another order and may
contract multiply-adds, so single elements can round to the neighbouring bf16 value); the
residual sum must be exact (both round one float32 addition).
"""

import pytest
import torch

from services.engine.kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_ULP = 2**-7


def triton_ops():
    from services.engine.kernels import triton_fused

    return triton_fused


def close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    if ref.numel() == 0:
        return out.shape == ref.shape
    scale = ref.float().abs().max().clamp(min=1.0)
    return bool(((out.float() - ref.float()).abs() <= BF16_ULP * scale).all())


@pytest.mark.parametrize("n, size", [(1, 4096), (7, 4096), (64, 4096), (3, 1000), (0, 128)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_reference(n, size, with_residual):
    g = torch.Generator(device="cuda").manual_seed(n * size)
    x = torch.randn(n, size, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(n, size, device="cuda", generator=g).to(torch.bfloat16) if with_residual else None
    w = (1 + 0.1 * torch.randn(size, device="cuda", generator=g)).to(torch.bfloat16)
    out, summed = triton_ops().add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_sum = reference.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(summed, ref_sum)
    assert close(out, ref_out)


@pytest.mark.parametrize("n, heads, head_dim", [(1, 40, 128), (9, 12, 64), (33, 3, 128)])
def test_rotate_heads_matches_reference_on_strided_heads(n, heads, head_dim):
    g = torch.Generator(device="cuda").manual_seed(heads)
    wide = torch.randn(n, heads + 5, head_dim, device="cuda", generator=g).to(torch.bfloat16)
    x = wide[:, :heads]  # a view into a merged q/k/v output: strided tokens
    positions = torch.randint(0, 32768, (n,), device="cuda", generator=g)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    cos, sin = angles.cos(), angles.sin()
    assert close(triton_ops().rotate_heads(x, cos, sin), reference.rotate_heads(x, cos, sin))


@pytest.mark.parametrize("n, inter", [(1, 14336), (5, 3000), (64, 14336)])
def test_silu_mul_matches_reference(n, inter):
    g = torch.Generator(device="cuda").manual_seed(inter)
    gate_up = (3 * torch.randn(n, 2 * inter, device="cuda", generator=g)).to(torch.bfloat16)
    assert close(triton_ops().silu_mul(gate_up), reference.silu_mul(gate_up))


def test_merged_decoder_matches_unmerged_reference():
    from services.engine import kernels
    from services.engine.models import DenseContext, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    c = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(c).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 512, (2 * 16,), device="cuda")
    pos = torch.arange(16, device="cuda").repeat(2)
    ctx = DenseContext(2, 16)
    with torch.inference_mode():
        kernels.use_kernels(False)
        try:
            ref = model(ids, pos, ctx, (0, 1)).hidden
        finally:
            kernels.use_kernels(True)
        model.merge_projections()
        out = model(ids, pos, ctx, (0, 1)).hidden
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 2e-2


def test_training_gets_gradients_through_every_fused_op():
    """The kernels have no backward: a tensor autograd records takes the reference."""
    from services.engine import kernels

    x = torch.randn(4, 256, device="cuda", requires_grad=True)
    w = torch.ones(256, device="cuda", requires_grad=True)
    cos, sin = torch.ones(4, 1, 64, device="cuda"), torch.zeros(4, 1, 64, device="cuda")
    out = kernels.add_rms_norm(x, x, w, 1e-5)[0].sum() + kernels.silu_mul(x).sum()
    out = out + kernels.rotate_heads(x.view(4, 4, 64), cos, sin).sum()
    out.backward()
    assert x.grad is not None and w.grad is not None and bool(x.grad.abs().sum() > 0)


@pytest.mark.parametrize("m", [1, 5, 16, 33, 64])
@pytest.mark.parametrize("n, k, split_k", [(300, 1000, 1), (4096, 14336, 4), (96, 4096, 2)])
def test_gemv_matches_linear_and_is_deterministic(m, n, k, split_k):
    from services.engine.kernels.triton_gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(m * n)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    out = gemv(x, w, split_k=split_k)
    assert close(out, torch.nn.functional.linear(x, w))
    assert torch.equal(out, gemv(x, w, split_k=split_k))


@pytest.mark.parametrize("m", [1, 5, 64, 65, 320])
@pytest.mark.parametrize(
    "n, k, split_k",
    [(300, 1000, 1), (4096, 14336, 1), (4096, 14336, 4), (6144, 8192, 1), (28672, 512, 1), (32000, 4096, 1)],
)
def test_fp8_gemv_matches_reference_and_is_deterministic(m, n, k, split_k):
    """Both multiply bf16 x by e4m3 values widened exactly and accumulate in float32; they
    differ in summation order only, so within one bf16 ulp of the output scale. A row's
    output is the same bits whatever other rows share the call."""
    from services.engine.kernels.triton_gemv import fp8_gemv
    from services.engine.models.fp8 import quantize_fp8

    g = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = quantize_fp8(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    tiles = (32, 256, 4, 4, split_k) if split_k > 1 else None  # None: fp8_tiles' choice
    out = fp8_gemv(x, w.data, w.scale, tiles)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert close(out, reference.fp8_linear(x, w.data, w.scale))
    assert torch.equal(out, fp8_gemv(x, w.data, w.scale, tiles))
    assert torch.equal(out[:1], fp8_gemv(x[:1], w.data, w.scale, tiles))  # rows alone


@pytest.mark.parametrize("n, k", [(4096, 4096), (32000, 4096), (128256, 4096)])
def test_dense_linear_streams_the_listed_shapes_and_rows_stay_alone(n, k):
    """``kernels.linear`` runs the GEMV for 1..DENSE_ROWS rows of a listed shape: within
    one bf16 ulp of cuBLAS, and a row's bits do not depend on the rows beside it; past
    DENSE_ROWS it is cuBLAS exactly."""
    from services.engine import kernels
    from services.engine.kernels.triton_gemv import DENSE_ROWS, DENSE_TILES, gemv

    g = torch.Generator(device="cuda").manual_seed(n)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(DENSE_ROWS + 1, k, device="cuda", generator=g).to(torch.bfloat16)
    for m in (1, 5, DENSE_ROWS):
        out = kernels.linear(x[:m], w)
        assert torch.equal(out, gemv(x[:m], w, *DENSE_TILES[(n, k)]))
        assert close(out, torch.nn.functional.linear(x[:m], w))
        assert torch.equal(out[:1], kernels.linear(x[:1], w))
    assert torch.equal(kernels.linear(x, w), torch.nn.functional.linear(x, w))


def test_fp8_linear_takes_the_kernel_for_bf16_on_cuda():
    from services.engine import kernels
    from services.engine.models.fp8 import quantize_fp8

    x = torch.randn(3, 512, device="cuda").to(torch.bfloat16)
    w = quantize_fp8(torch.randn(256, 512, device="cuda"))
    assert close(kernels.fp8_linear(x, w.data, w.scale), reference.fp8_linear(x, w.data, w.scale))


@pytest.mark.parametrize("rows, n", [(1, 128256), (5, 32000), (64, 151936)])
def test_argmax_rows_is_torch_argmax(rows, n):
    from services.engine.sampling.sampler import argmax_rows

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randint(0, 1000, (rows, n), device="cuda", generator=g).float()  # ties
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
