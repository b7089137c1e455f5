"""The torch reference attention against a float64 dense computation."""

import dataclasses

import pytest
import torch

from kvcore.ops import AttentionParams, reference
from tests.kvcore.ops.cases import assert_matches_dense, make_case

FP8 = getattr(torch, "float8_e4m3fn", None)


def test_decode_varlen_gqa():
    case = make_case([1, 17, 40, 100], [1, 1, 1, 1], num_q_heads=8, num_kv_heads=2)
    out = reference.decode_attention(
        case.query, case.kv_pool, case.layer, case.uniform_batch(1), case.params()
    )
    assert_matches_dense(out, case)


@pytest.mark.parametrize("q_len", [2, 4, 8])
def test_verify_is_causal_inside_the_block(q_len):
    case = make_case([q_len, 33, 64], [q_len] * 3, seed=q_len)
    query = case.query.view(3, q_len, *case.query.shape[1:])
    out = reference.verify_attention(
        query, case.kv_pool, case.layer, case.uniform_batch(q_len), case.params()
    )
    assert out.shape == query.shape
    assert_matches_dense(out.reshape(case.query.shape), case)


def test_prefill_over_cached_prefix():
    case = make_case([50, 80, 33], [20, 80, 1], tokens_per_page=16, seed=3)
    assert_matches_dense(reference.prefill_attention(*case.args()), case)


def test_varlen_with_empty_sequences():
    case = make_case([9, 5, 30, 70], [3, 0, 1, 7], seed=4)
    assert_matches_dense(reference.paged_attention(*case.args()), case)


@pytest.mark.parametrize("tokens_per_page", [1, 4, 16, 64])
def test_page_sizes(tokens_per_page):
    case = make_case([3, 70, 129], [3, 5, 1], tokens_per_page=tokens_per_page, seed=5)
    assert_matches_dense(reference.paged_attention(*case.args()), case)


@pytest.mark.parametrize("window,tokens_per_page", [(1, 16), (5, 16), (20, 16), (40, 8), (7, 1), (100, 16)])
def test_sliding_window_never_reads_released_pages(window, tokens_per_page):
    case = make_case(
        [1, 30, 100, 150], [1, 4, 8, 30], window=window, tokens_per_page=tokens_per_page, seed=window
    )
    if window < 100:
        assert (case.block_table == -1).sum() > case.block_table.shape[0]  # some released
    assert_matches_dense(reference.paged_attention(*case.args()), case)


@pytest.mark.parametrize("window", [0, 5, 40])
def test_keys_below_key_start_are_never_read(window):
    """An EAGLE-3 drafter's first slot (position 0) is written but attended by no query."""
    case = make_case([1, 3, 30, 100], [1, 3, 4, 8], window=window, key_start=1, seed=11)
    out = reference.paged_attention(*case.args())
    assert bool(out[0].eq(0).all())  # the lone query at position 0 sees no key
    assert_matches_dense(out, case)
    decode = make_case([1, 2, 17, 40], [1, 1, 1, 1], window=window, key_start=1, seed=12)
    out = reference.decode_attention(
        decode.query, decode.kv_pool, decode.layer, decode.uniform_batch(1), decode.params()
    )
    assert_matches_dense(out, decode)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_head_groupings(heads):
    num_q_heads, num_kv_heads = heads
    case = make_case([20, 45], [4, 4], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    assert_matches_dense(reference.paged_attention(*case.args()), case)


@pytest.mark.parametrize(
    "pool_dtype,query_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        pytest.param(FP8, torch.bfloat16, marks=pytest.mark.skipif(FP8 is None, reason="no fp8")),
        pytest.param(FP8, torch.float32, marks=pytest.mark.skipif(FP8 is None, reason="no fp8")),
    ],
)
def test_dtypes(pool_dtype, query_dtype):
    case = make_case(
        [17, 64, 90], [1, 5, 20], pool_dtype=pool_dtype, query_dtype=query_dtype, window=30, seed=7
    )
    assert_matches_dense(reference.paged_attention(*case.args()), case)


def test_padding_row_with_empty_context_outputs_zeros():
    case = make_case([0, 12], [1, 1], seed=8)
    out = reference.decode_attention(
        case.query, case.kv_pool, case.layer, case.uniform_batch(1), case.params()
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_matches_dense(out, case)


def test_entries_past_the_extent_are_ignored():
    case = make_case([20], [2], tokens_per_page=16, seed=9)
    wide = torch.full((1, 6), -1, dtype=torch.int32)
    wide[0, :2] = case.block_table[0, :2]
    case.block_table = wide
    assert_matches_dense(reference.paged_attention(*case.args()), case)


@pytest.mark.parametrize(
    "field,mutate",
    [
        ("query", lambda a: a.update(query=a["query"][:, :3])),
        ("query", lambda a: a.update(query=a["query"][..., :16])),
        ("layer", lambda a: a.update(layer=2)),
        ("block_table", lambda a: a.update(block_table=a["block_table"][:1])),
        ("block_table", lambda a: a.update(block_table=a["block_table"].float())),
        ("query_start_loc", lambda a: a.update(query_start_loc=a["query_start_loc"][:2])),
        ("seq_lens", lambda a: a.update(seq_lens=a["seq_lens"][:, None])),
        ("window", lambda a: a.update(window=-1)),
        ("key_start", lambda a: a.update(key_start=-1)),
        ("kv_pool", lambda a: a.update(kv_pool=a["kv_pool"][0])),
    ],
)
def test_bad_input_names_the_field(field, mutate):
    case = make_case([5, 9], [1, 2])
    names = [
        "query",
        "kv_pool",
        "layer",
        "block_table",
        "query_start_loc",
        "seq_lens",
        "scale",
        "window",
        "key_start",
    ]
    args = {name: getattr(case, name) for name in names}
    mutate(args)
    with pytest.raises(ValueError, match=f"^{field}:"):
        reference.paged_attention(*dataclasses.replace(case, **args).args())


def test_uniform_attention_takes_a_uniform_batch_of_its_q_len():
    """decode and verify read no query starts: a varlen batch, or one of another q_len, is
    refused by name; so is a varlen batch whose max_q_len is below its longest query."""
    case = make_case([5, 9], [1, 1])
    with pytest.raises(ValueError, match="^query_start_loc:"):
        reference.decode_attention(case.query, case.kv_pool, case.layer, case.batch(), case.params())
    with pytest.raises(ValueError, match="^max_q_len:"):
        reference.decode_attention(case.query, case.kv_pool, case.layer, case.uniform_batch(2), case.params())
    verify = make_case([5, 9], [2, 2])
    query = verify.query.view(2, 2, *verify.query.shape[1:])
    with pytest.raises(ValueError, match="^max_q_len:"):
        reference.verify_attention(
            query, verify.kv_pool, verify.layer, verify.uniform_batch(3), verify.params()
        )
    short = dataclasses.replace(verify.batch(), max_q_len=1)
    with pytest.raises(ValueError, match="^max_q_len:"):
        reference.paged_attention(verify.query, verify.kv_pool, verify.layer, short, verify.params())


def test_attention_params_refuse_a_softcap():
    with pytest.raises(ValueError, match="^softcap:"):
        AttentionParams(0.125, softcap=50.0)
