"""KV writes, page pack/unpack/copy and slot mappings: exact, bit for bit."""

import pytest
import torch

from kvcore.ops import (
    RotaryWrite,
    copy_pages,
    pack_pages,
    query_positions,
    slot_mapping_for,
    slots_at,
    unpack_pages,
)
from kvcore.ops import reference as ref
from kvcore.ops.reference import to_pool_dtype

FP8 = getattr(torch, "float8_e4m3fn", None)
DTYPES = [torch.float32, torch.float16, torch.bfloat16] + ([FP8] if FP8 is not None else [])


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so NaN payloads and fp8 compare exactly."""
    return t.contiguous().view(torch.uint8)


def random_pool(dtype, num_pages=6, num_layers=3, num_kv_heads=4, tokens_per_page=4, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, num_layers, 2, num_kv_heads, tokens_per_page, head_dim)
    return to_pool_dtype(torch.randn(shape, generator=gen) * 3, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_stores_exactly_the_mapped_slots(dtype):
    pool = random_pool(dtype)
    before = pool.clone()
    key = torch.randn(5, 4, 8) * 3
    value = torch.randn(5, 4, 8) * 3
    slots = torch.tensor([9, -1, 0, 23, -1])  # (page 2, 1), skip, (0, 0), (5, 3), skip
    ref.write_kv(pool, 1, key, value, slots)
    expected = before.clone()
    for i, (page, offset) in {0: (2, 1), 2: (0, 0), 3: (5, 3)}.items():
        expected[page, 1, 0, :, offset] = to_pool_dtype(key[i], dtype)
        expected[page, 1, 1, :, offset] = to_pool_dtype(value[i], dtype)
    assert torch.equal(bits(pool), bits(expected))


@pytest.mark.skipif(FP8 is None, reason="no fp8")
def test_write_kv_fp8_saturates():
    pool = random_pool(FP8)
    key = torch.full((1, 4, 8), 1e4)
    value = torch.full((1, 4, 8), -1e4)
    ref.write_kv(pool, 0, key, value, torch.tensor([5]))
    assert torch.equal(pool[1, 0, 0, :, 1].float(), torch.full((4, 8), 448.0))
    assert torch.equal(pool[1, 0, 1, :, 1].float(), torch.full((4, 8), -448.0))


def rope_tables(n: int, head_dim: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, 1, head_dim] float32 whose halves repeat, as the models' Rotary gives."""
    angles = torch.rand(n, head_dim // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_rotated_kv_is_rotation_then_write(dtype):
    """q and k turn by pairs (i, i + head_dim / 2) in float32, rounded to qkv's dtype; the
    rotated k and the untouched v land where write_kv puts them."""
    gen = torch.Generator().manual_seed(3)
    qkv = (torch.randn(5, 8 + 2 * 4, 8, generator=gen) * 3).to(torch.bfloat16)  # 8 q, 4 k, 4 v heads
    cos, sin = rope_tables(5, 8)
    slots = torch.tensor([9, -1, 0, 23, -1])
    pool, expected = random_pool(dtype), random_pool(dtype)
    q = ref.write_rotated_kv(pool, 1, qkv, 8, RotaryWrite(cos, sin, slots))
    x = qkv[:, :12].float()
    x1, x2 = x[..., :4], x[..., 4:]
    c, s = cos[..., :4], sin[..., :4]
    turned = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(torch.bfloat16)
    ref.write_kv(expected, 1, turned[:, 8:], qkv[:, 12:], slots)
    assert q.shape == (5, 8, 8) and torch.equal(q, turned[:, :8])
    assert torch.equal(bits(pool[:, 0]), bits(expected[:, 0])) and torch.equal(
        bits(pool[:, 2]), bits(expected[:, 2])
    )


def test_write_rotated_kv_rejects_a_qkv_of_other_heads():
    pool = random_pool(torch.float32)
    cos, sin = rope_tables(2, 8)
    with pytest.raises(ValueError, match="^qkv:"):
        ref.write_rotated_kv(
            pool, 0, torch.zeros(2, 8 + 4, 8), 8, RotaryWrite(cos, sin, torch.tensor([0, 1]))
        )
    with pytest.raises(ValueError, match="^cos:"):
        ref.write_rotated_kv(
            pool, 0, torch.zeros(2, 16, 8), 8, RotaryWrite(cos[:1], sin, torch.tensor([0, 1]))
        )


def test_write_kv_rejects_mismatched_shapes():
    pool = random_pool(torch.float32)
    with pytest.raises(ValueError, match="^key:"):
        ref.write_kv(pool, 0, torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="^slot_mapping:"):
        ref.write_kv(pool, 0, torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.tensor([0]))
    with pytest.raises(ValueError, match="^layer:"):
        ref.write_kv(pool, 3, torch.zeros(1, 4, 8), torch.zeros(1, 4, 8), torch.tensor([0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_round_trip_is_bit_exact(dtype):
    src = random_pool(dtype, seed=1)
    src[4] = to_pool_dtype(torch.full(src.shape[1:], float("nan")), dtype)
    dst = random_pool(dtype, seed=2)
    untouched = dst[[0, 2]].clone()
    packed = pack_pages(src, torch.tensor([3, 4, 1], dtype=torch.int32))
    assert packed.is_contiguous() and packed.shape == (3, *src.shape[1:])
    unpack_pages(dst, torch.tensor([5, 1, 3]), packed)
    assert torch.equal(bits(dst[[5, 1, 3]]), bits(src[[3, 4, 1]]))
    assert torch.equal(bits(dst[[0, 2]]), bits(untouched))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_head_range(dtype):
    src = random_pool(dtype, seed=3)
    dst = random_pool(dtype, seed=4)
    before = dst.clone()
    packed = pack_pages(src, torch.tensor([2, 0]), heads=slice(1, 3))
    assert packed.is_contiguous() and packed.shape == (2, 3, 2, 2, 4, 8)
    unpack_pages(dst, torch.tensor([4, 5]), packed, heads=slice(2, 4))
    assert torch.equal(bits(dst[[4, 5], :, :, 2:4]), bits(src[[2, 0], :, :, 1:3]))
    assert torch.equal(bits(dst[:, :, :, :2]), bits(before[:, :, :, :2]))
    assert torch.equal(bits(dst[:4]), bits(before[:4]))


def test_unpack_rejects_wrong_shape_and_dtype():
    pool = random_pool(torch.bfloat16)
    with pytest.raises(ValueError, match="^packed:"):
        unpack_pages(pool, torch.tensor([0]), torch.zeros(2, *pool.shape[1:], dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="^packed:"):
        unpack_pages(pool, torch.tensor([0]), torch.zeros(1, *pool.shape[1:]))
    with pytest.raises(ValueError, match="^page_ids:"):
        pack_pages(pool, torch.tensor([[0]]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_pages_reads_every_source_before_writing(dtype):
    pool = random_pool(dtype, seed=5)
    before = pool.clone()
    copy_pages(pool, torch.tensor([1, 2]), torch.tensor([2, 3]))
    assert torch.equal(bits(pool[[2, 3]]), bits(before[[1, 2]]))
    assert torch.equal(bits(pool[[0, 1, 4, 5]]), bits(before[[0, 1, 4, 5]]))
    with pytest.raises(ValueError, match="^dst_page_ids:"):
        copy_pages(pool, torch.tensor([1, 2]), torch.tensor([3]))


def test_slot_mapping_for_batch():
    table = torch.tensor([[7, 2, -1, -1], [-1, 4, 5, -1]], dtype=torch.int32)
    slots = slot_mapping_for(table, [3, 5], [3, 4], tokens_per_page=4)
    # row 0: positions 3,4,5 -> (7,3), (2,0), (2,1); row 1: 5,6,7,8 -> (4,1..3), (5,0)
    assert slots.tolist() == [31, 8, 9, 17, 18, 19, 20]
    assert slots.dtype == torch.int64


def test_slot_mapping_for_null_and_past_the_table_is_minus_one():
    row = torch.tensor([-1, 3], dtype=torch.int32)
    assert slot_mapping_for(row, 1, 6, tokens_per_page=2).tolist() == [-1, 6, 7, -1, -1, -1]
    assert slot_mapping_for(row, 0, 0, tokens_per_page=2).tolist() == []
    with pytest.raises(ValueError, match="^lengths:"):
        slot_mapping_for(row, [0], [1, 2], tokens_per_page=2)


def test_query_positions():
    starts = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    seq_lens = torch.tensor([10, 4, 3], dtype=torch.int32)
    assert query_positions(starts, seq_lens).tolist() == [8, 9, 0, 1, 2]


def test_slot_mapping_for_host_tables_follows_the_rule_position_by_position():
    """Host tables take a numpy path: every slot is the table's page times the page size
    plus the offset, or -1 for a NULL page or a position past the table."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        batch, width, page = int(torch.randint(1, 6, (1,), generator=gen)), 7, 4
        table = torch.randint(-1, 9, (batch, width), generator=gen, dtype=torch.int32)
        starts = torch.randint(0, 30, (batch,), generator=gen).tolist()
        lens = torch.randint(0, 6, (batch,), generator=gen).tolist()
        expected = []
        for b in range(batch):
            for pos in range(starts[b], starts[b] + lens[b]):
                i = pos // page
                held = i < width and int(table[b, i]) != -1
                expected.append(int(table[b, i]) * page + pos % page if held else -1)
        slots = slot_mapping_for(table, starts, lens, tokens_per_page=page)
        assert slots.tolist() == expected and slots.dtype == torch.int64


def test_slots_at_gives_the_same_slots_on_tensors_as_on_numpy_arrays():
    """The tensor form (what the draft chain's graph computes on the device, run here on
    the CPU) against the numpy form and the rule, over [rows, q] positions of one row each."""
    gen = torch.Generator().manual_seed(5)
    table = torch.randint(-1, 9, (4, 5), generator=gen, dtype=torch.int32)
    positions = torch.randint(0, 30, (4, 3), generator=gen)  # past the table too: 5 pages of 4
    rows = torch.arange(4)[:, None]
    on_tensors = slots_at(table, rows, positions, 4)
    on_arrays = slots_at(table.numpy(), rows.numpy(), positions.numpy(), 4)
    expected = [
        [int(table[b, p // 4]) * 4 + p % 4 if p // 4 < 5 and int(table[b, p // 4]) != -1 else -1 for p in row]
        for b, row in enumerate(positions.tolist())
    ]
    assert on_tensors.tolist() == on_arrays.tolist() == expected
    assert on_tensors.dtype == torch.int64
    assert slots_at(table[:, :0], rows, positions, 4).tolist() == [[-1] * 3] * 4
