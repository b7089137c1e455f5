"""Triton paged attention against the float64 dense computation and the torch reference.

Outputs are filled with NaN before each kernel run, so a row left unwritten fails.
"""

import pytest
import torch

from tests.kvcore.ops.cases import assert_matches_dense, make_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP8 = getattr(torch, "float8_e4m3fn", None)


def run_kernel(case, **launch):
    from kvcore.ops.triton_attention import launch_attention

    out = torch.full_like(case.query, float("nan"))
    launch_attention(out, case.query, case.kv_pool[:, case.layer], case.batch(), case.params(), **launch)
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16, FP8])
@pytest.mark.parametrize("tokens_per_page", [16, 64, 128])
@pytest.mark.parametrize("num_splits", [1, 7])
def test_decode_and_verify(pool_dtype, tokens_per_page, num_splits):
    query_dtype = torch.float16 if pool_dtype == torch.float16 else torch.bfloat16
    for q_len in (1, 5, 8):
        case = make_case(
            [q_len, 100, 300, 517],
            [q_len] * 4,
            tokens_per_page=tokens_per_page,
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=128,
            pool_dtype=pool_dtype,
            query_dtype=query_dtype,
            seed=q_len,
            device="cuda",
        )
        assert_matches_dense(run_kernel(case, num_splits=num_splits, block_n=32), case)


@pytest.mark.parametrize("window,tokens_per_page", [(1, 16), (5, 16), (40, 16), (100, 64), (300, 128)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_sliding_window_skips_null_pages(window, tokens_per_page, num_splits):
    case = make_case(
        [1, 30, 200, 600],
        [1, 4, 8, 8],
        window=window,
        tokens_per_page=tokens_per_page,
        seed=window,
        device="cuda",
    )
    assert_matches_dense(run_kernel(case, num_splits=num_splits), case)


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_keys_below_key_start_are_never_read(window, num_splits):
    for q_len in (1, 5, 30):
        case = make_case(
            [q_len, 3, 130, 300], [q_len, 3, 5, 5], window=window, key_start=1, seed=q_len, device="cuda"
        )
        assert_matches_dense(run_kernel(case, num_splits=num_splits), case)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, FP8])
def test_prefill_over_cached_prefix_varlen(pool_dtype):
    case = make_case(
        [300, 77, 9, 600],
        [200, 77, 0, 150],
        window=0,
        pool_dtype=pool_dtype,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        seed=11,
        device="cuda",
    )
    assert_matches_dense(run_kernel(case), case)


def test_prefill_windowed_gqa_odd_group():
    case = make_case(
        [260, 90], [260, 40], window=70, num_q_heads=6, num_kv_heads=1, head_dim=80, seed=12, device="cuda"
    )
    assert_matches_dense(run_kernel(case), case)


def test_padding_rows_output_zeros():
    case = make_case([0, 40, 0], [1, 1, 1], seed=13, device="cuda")
    for num_splits in (1, 3):
        out = run_kernel(case, num_splits=num_splits)
        assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
        assert_matches_dense(out, case)


@pytest.mark.parametrize("seed", range(3))
def test_public_api_matches_reference_at_model_shape(seed):
    from kvcore.ops import decode_attention, reference, verify_attention

    case = make_case(
        [2048, 1500, 33, 4000],
        [8] * 4,
        tokens_per_page=16,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        seed=seed,
        device="cuda",
    )
    q = case.query.view(4, 8, 32, 128)
    args = (case.kv_pool, case.layer, case.uniform_batch(8), case.params())
    out = verify_attention(q, *args)
    ref = reference.verify_attention(q, *args)
    assert relative_error(out, ref) < 1e-2
    last = q[:, -1].contiguous()
    args = (case.kv_pool, case.layer, case.uniform_batch(1), case.params())
    assert relative_error(decode_attention(last, *args), reference.decode_attention(last, *args)) < 1e-2


def test_decode_step_captures_in_a_cuda_graph():
    from kvcore.ops import decode_attention, reference, write_kv

    case = make_case([100, 37], [1, 1], tokens_per_page=16, seed=14, device="cuda")
    key = torch.randn(2, 2, 32, device="cuda")
    value = torch.randn(2, 2, 32, device="cuda")
    slots = torch.tensor([-1, -1], device="cuda")
    q = case.query.clone()
    args = (case.kv_pool, case.layer, case.uniform_batch(1), case.params())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv(case.kv_pool, case.layer, key, value, slots)
        out = decode_attention(q, *args)
    q.copy_(torch.randn_like(q))
    key.copy_(torch.randn_like(key))
    slots.copy_(torch.tensor([int(case.block_table[0, 6]) * 16 + 3, -1]))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, reference.decode_attention(q, *args)) < 1e-2


@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("window", [0, 40])
def test_attention_sinks_match_the_reference(num_splits, window):
    """gpt-oss's per-head sink logits: the kernel starts the first split's softmax at the
    sink; the reference scales its rows by sum / (sum + exp(sink))."""
    from dataclasses import replace

    from kvcore.ops import reference
    from kvcore.ops.triton_attention import launch_attention

    case = make_case([1, 30, 200, 600], [1, 4, 8, 8], window=window, num_q_heads=8, seed=3, device="cuda")
    sinks = torch.randn(8, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)) * 2
    params = replace(case.params(), sinks=sinks.to(torch.bfloat16))
    out = torch.full_like(case.query, float("nan"))
    launch_attention(
        out, case.query, case.kv_pool[:, case.layer], case.batch(), params, num_splits=num_splits
    )
    ref = reference.paged_attention(case.query, case.kv_pool, case.layer, case.batch(), params)
    assert relative_error(out, ref) < 1e-2
