"""GPU KV writes and page moves: bit-exact against the torch reference on the CPU."""

import pytest
import torch

from kvcore.ops import RotaryWrite, copy_pages, pack_pages, unpack_pages, write_kv, write_rotated_kv
from kvcore.ops import reference as ref
from kvcore.ops.reference import to_pool_dtype

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP8 = getattr(torch, "float8_e4m3fn", None)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, FP8]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def random_pool(dtype, num_pages=40, tokens_per_page=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, 3, 2, 8, tokens_per_page, 128)
    return to_pool_dtype(torch.randn(shape, generator=gen) * 100, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_rotated_kv_matches_reference(dtype):
    """v is stored bit for bit; the rotated q and k within one ulp of the reference's (the
    kernel may fuse a multiply-add the reference rounds twice): bf16 for q and 16-bit
    pools, fp8 for an fp8 pool. Other layers and unmapped slots stay untouched."""
    cpu_pool = random_pool(dtype)
    gpu_pool = cpu_pool.cuda()
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(300, 48, 128, generator=gen) * 3).to(torch.bfloat16)  # 32 q, 8 k, 8 v heads
    angles = torch.rand(300, 64, generator=gen) * 6.3
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(40 * 16, generator=gen)[:300]
    slots[::7] = -1
    q_ref = ref.write_rotated_kv(cpu_pool, 2, qkv, 32, RotaryWrite(cos, sin, slots))
    q = write_rotated_kv(gpu_pool, 2, qkv.cuda(), 32, RotaryWrite(cos.cuda(), sin.cuda(), slots.cuda()))
    ulp = 2**-3 if dtype == FP8 else 2**-7
    torch.testing.assert_close(q.cpu().float(), q_ref.float(), rtol=2**-7, atol=2**-7)
    got, want = gpu_pool.cpu(), cpu_pool
    assert torch.equal(bits(got[:, 2, 1]), bits(want[:, 2, 1]))
    torch.testing.assert_close(got[:, 2, 0].float(), want[:, 2, 0].float(), rtol=ulp, atol=ulp)
    assert torch.equal(bits(got[:, :2]), bits(want[:, :2]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference_bit_for_bit(dtype, source_dtype):
    cpu_pool = random_pool(dtype)
    gpu_pool = cpu_pool.cuda()
    qkv = (torch.randn(300, 48, 128) * 300).to(source_dtype)  # fused q|k|v heads: strided k, v
    key, value = qkv[:, 32:40], qkv[:, 40:]
    slots = torch.randperm(40 * 16)[:300]
    slots[::7] = -1
    ref.write_kv(cpu_pool, 2, key, value, slots)
    write_kv(gpu_pool, 2, key.cuda(), value.cuda(), slots.cuda())
    assert torch.equal(bits(gpu_pool), bits(cpu_pool))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_copy_on_gpu(dtype):
    src = random_pool(dtype, seed=1).cuda()
    dst = random_pool(dtype, seed=2).cuda()
    ids = torch.randperm(40)[:17].cuda()
    packed = pack_pages(src, ids)
    unpack_pages(dst, ids.flip(0), packed)
    assert torch.equal(bits(dst[ids.flip(0)]), bits(src[ids]))
    half = pack_pages(src, ids, heads=slice(4, 8))
    unpack_pages(dst, ids, half, heads=slice(0, 4))
    assert torch.equal(bits(dst[ids][:, :, :, :4]), bits(src[ids][:, :, :, 4:]))
    copy_pages(dst, ids[:5], ids[5:10])
    assert torch.equal(bits(dst[ids[5:10]]), bits(dst[ids[:5]]))
