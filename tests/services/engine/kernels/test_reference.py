"""The fused ops' reference path (what CPU runs) and merged projections, on the CPU."""

import torch

from services.engine import kernels
from services.engine.kernels import reference
from services.engine.models import DenseContext, LlamaConfig, LlamaForCausalLM


def test_add_rms_norm_is_the_unfused_residual_then_norm():
    torch.manual_seed(0)
    x, res, w = torch.randn(5, 32), torch.randn(5, 32), torch.rand(32)
    out, summed = reference.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(summed, res + x)
    assert torch.equal(out, reference.rms_norm(res + x, w, 1e-6))
    out0, summed0 = reference.add_rms_norm(x, None, w, 1e-6)
    assert summed0 is x and torch.equal(out0, reference.rms_norm(x, w, 1e-6))


def test_silu_mul_reads_gate_rows_first():
    gate_up = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
    expected = torch.nn.functional.silu(torch.tensor([[1.0, -2.0]])) * torch.tensor([[3.0, 4.0]])
    assert torch.equal(reference.silu_mul(gate_up), expected)


def test_merged_projections_keep_names_values_and_outputs():
    torch.manual_seed(0)
    c = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        model_type="qwen2",
    )
    model = LlamaForCausalLM(c).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, pos = torch.randint(0, 64, (8,)), torch.arange(8)
    with torch.inference_mode():
        ref = model(ids, pos, DenseContext(1, 8), (0,))
        model.merge_projections()
        out = model(ids, pos, DenseContext(1, 8), (0,))
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv[0].data_ptr()  # a view, not a copy
    torch.testing.assert_close(out.hidden, ref.hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.aux, ref.aux, rtol=1e-5, atol=1e-5)


def test_linear_is_f_linear_off_cuda():
    """On the CPU ``kernels.linear`` is ``F.linear``, for a shape the GEMV lists too."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(32, generator=g)
    assert torch.equal(kernels.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    xb = torch.randn(2, 4096, generator=g).to(torch.bfloat16)
    wb = torch.randn(4096, 4096, generator=g).to(torch.bfloat16)
    assert torch.equal(kernels.linear(xb, wb), torch.nn.functional.linear(xb, wb))
