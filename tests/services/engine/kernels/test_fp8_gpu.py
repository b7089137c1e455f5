"""The CUDA FP8 matmuls (``kernels/fp8_cuda.py``) against the reference that dequantizes
(``kernels/fp8_reference.py``), on random bf16 activations: cuBLASLt's FP8 GEMM and the
weight-streaming kernel with e4m3 activations, per token and static, the block-scaled path,
and a graph capture of each (no host synchronisation in the forward).

Tolerance: the paths sum the same e4m3 products in float32 in another order, then round to
bf16: a bf16 ulp of the output scale, twice (activations requantized from bf16 may land on
the other side of an e4m3 rounding boundary in a few elements)."""

from dataclasses import replace

import pytest
import torch

from services.engine.kernels import fp8_reference
from services.engine.models.fp8 import quantize_fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_ULP = 2**-7
SHAPES = [(1, 4096, 4096), (2, 1024, 4096), (64, 6144, 4096), (300, 4096, 14336)]


def cuda_ops():
    from services.engine.kernels import fp8_cuda  # noqa: PLC0415 (needs Triton: GPU installs only)

    return fp8_cuda


def close(out: torch.Tensor, ref: torch.Tensor, ulps: float = 2) -> None:
    scale = ref.float().abs().max().clamp(min=1.0)
    err = (out.float() - ref.float()).abs().max()
    assert err <= ulps * BF16_ULP * scale, f"max error {err:.4g} at output scale {scale:.4g}"


def weight(n: int, k: int, act: str, block: int = 0):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    q = quantize_fp8(w, act=act)
    if act == "static":
        q = replace(q, input_scale=torch.tensor(0.01, device="cuda"))
    if block:  # block scales: the same rows' scale repeated over every 128-column block
        q = replace(q, block=block, scale=q.scale[:, None].repeat(1, -(-k // block)).contiguous())
    return q


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("act", ["token", "static", "none"])
def test_cuda_fp8_linear_matches_the_reference(m, n, k, act):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = weight(n, k, act)
    close(cuda_ops().fp8_scaled_linear(x, w), fp8_reference.fp8_scaled_linear(x, w))


@pytest.mark.parametrize("m", [1, 64])
def test_block_scaled_path_matches_the_reference(m):
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    w = replace(weight(1024, 4096, "token", block=128), act="group")
    close(cuda_ops().fp8_scaled_linear(x, w), fp8_reference.fp8_scaled_linear(x, w), ulps=4)


@pytest.mark.parametrize("m", [1, 64])
def test_graph_replay_equals_eager(m):
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    w = weight(4096, 4096, "token")
    eager = cuda_ops().fp8_scaled_linear(x, w)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cuda_ops().fp8_scaled_linear(x, w)  # warm up (Triton compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_ops().fp8_scaled_linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_gemv_over_quantized_rows_matches_the_reference():
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = weight(4096, 4096, "token")
    rows = cuda_ops().quantized_rows(x, w)
    one = cuda_ops().fp8_gemv(rows, w.data, w.scale)
    ref = fp8_reference.fp8_scaled_linear(x, w)
    close(one, ref)


@pytest.mark.parametrize("m,k", [(1, 4096), (3, 14336), (64, 1000), (2, 5)])
def test_one_launch_row_quantization_gives_the_references_bytes(m, k):
    from services.engine.kernels.triton_fp8_quant import quantize_rows_cuda  # noqa: PLC0415 (Triton)

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    x[0, : min(k, 7)] = 0
    if m > 1:
        x[1] = 0  # an all-zero row: scale 1, zeros
    data, scale = quantize_rows_cuda(x)
    ref_data, ref_scale = fp8_reference.quantize_rows(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (2, 4096, 14336), (2, 6144, 4096)])
def test_gemv_quantizing_its_rows_equals_the_gemv_over_quantized_rows(m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = weight(n, k, "token")
    fused = cuda_ops().fp8_gemv(x, w.data, w.scale, quantize=True)
    apart = cuda_ops().fp8_gemv(cuda_ops().quantized_rows(x, w), w.data, w.scale)
    close(fused, apart, ulps=1)
    close(fused, fp8_reference.fp8_scaled_linear(x, w))
