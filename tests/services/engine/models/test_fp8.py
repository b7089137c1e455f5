"""fp8 weights (``models/fp8.py``): per-row e4m3 rounding, the linear over them, and the
drafter's quantization: every linear fp8 at decode sizes, the weight as loaded above."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.engine.kernels import reference
from services.engine.models import Eagle3Drafter
from services.engine.models.attention import Attention
from services.engine.models.fp8 import FP8, FP8_MAX, FP8_ROWS, Fp8Linear, linear, quantize_fp8
from services.engine.models.layers import SwiGLU
from tests.services.engine.helpers import drafter_config, randomize

E4M3_HALF_ULP = 2**-4  # relative rounding error of a normal e4m3 value (3 mantissa bits)
E4M3_MIN_NORMAL = 2**-6


def test_each_row_keeps_its_range_and_rounds_to_e4m3():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=g) * torch.logspace(-3, 2, 48)[:, None]  # rows of any range
    w[5] = 0.0
    q = quantize_fp8(w)
    assert q.data.dtype == FP8 and q.data.shape == (48, 80) and q.scale.shape == (48,)
    assert torch.equal(q.scale[5], torch.tensor(1.0))
    amax = w.abs().amax(dim=1)
    assert torch.allclose(q.scale[amax > 0], amax[amax > 0] / FP8_MAX)
    assert torch.equal(q.data.float().abs().amax(dim=1)[amax > 0], torch.full((47,), FP8_MAX))
    bound = E4M3_HALF_ULP * w.abs() + q.scale[:, None] * E4M3_MIN_NORMAL * 2**-3  # subnormals
    assert bool(((q.dequantized() - w).abs() <= bound).all())


def test_linear_over_fp8_is_the_dequantized_linear():
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(24, 40, generator=g), torch.randn(24, generator=g), torch.randn(5, 40, generator=g)
    q = quantize_fp8(w)
    want = F.linear(x, q.dequantized(), b)
    assert torch.allclose(linear(x, q, b), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))  # a plain weight: F.linear itself


@pytest.mark.parametrize("merged", [True, False])
def test_projections_quantize_merged_or_not_to_the_same_outputs(merged):
    attn, mlp = Attention(32, 32, 4, 2, 8), SwiGLU(32, 48)
    randomize(attn, 2)
    randomize(mlp, 3)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4))
    gate_w, up_w = mlp.gate_proj.weight.detach().clone(), mlp.up_proj.weight.detach().clone()
    if merged:
        attn.merge()
        mlp.merge()
    attn.quantize_fp8()
    mlp.quantize_fp8()
    assert all(isinstance(m, Fp8Linear) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
    if merged:  # the parts are views of the merged rows: one copy in memory
        ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
        assert ptr(attn.v_proj.weight.data) == ptr(attn.qkv[0].data)
        assert ptr(mlp.up_proj.weight.data) == ptr(mlp.gate_up.data)
    # per-row scales: each part's rows are what quantizing the part alone gives
    for part, w in ((mlp.gate_proj, gate_w), (mlp.up_proj, up_w)):
        alone = quantize_fp8(w)
        assert torch.equal(part.weight.data.float(), alone.data.float())
        assert torch.equal(part.weight.scale, alone.scale)
    gate, up = linear(x, mlp.gate_proj.weight), linear(x, mlp.up_proj.weight)
    assert torch.allclose(mlp(x), mlp.down_proj(F.silu(gate) * up), atol=1e-5)


def test_every_drafter_linear_is_fp8_at_decode_sizes_and_dense_above():
    drafter = Eagle3Drafter(drafter_config(draft_vocab=32), own_head=True)
    randomize(drafter, 5)
    drafter.merge_projections()
    head = drafter.lm_head.weight.detach().clone()
    drafter.quantize_fp8()
    linears = [n for n, m in drafter.named_modules() if isinstance(m, nn.Linear)]
    assert linears == []
    assert isinstance(drafter.fc, Fp8Linear) and isinstance(drafter.lm_head, Fp8Linear)
    assert [n for n, p in drafter.named_parameters() if p.ndim == 2] == []
    g = torch.Generator().manual_seed(6)
    small, large = torch.randn(FP8_ROWS, 64, generator=g), torch.randn(FP8_ROWS + 1, 64, generator=g)
    w = drafter.lm_head.weight
    assert torch.equal(drafter.lm_head(small), reference.fp8_linear(small, w.data, w.scale))
    assert torch.equal(drafter.lm_head(large), F.linear(large, head))  # the weight as loaded
    merged = drafter.midlayer.mlp.gate_up
    assert merged.dense is not None and merged.dense.dtype == torch.float32
