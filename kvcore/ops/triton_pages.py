"""Triton page moves for pack/unpack: page i of ``src`` (id ``src_ids[i]``, or i) goes to
page ``dst_ids[i]`` (or i) of ``dst``.

A page [num_layers, 2, num_heads, P, head_dim] restricted to a head range is
``num_layers * 2`` runs of ``num_heads_moved * P * head_dim`` contiguous elements, so each
program copies one BLOCK-sized piece of one run with 16-byte accesses. Elements move as
same-size integers: every dtype (fp8 included) round-trips bit-exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore.ops.pages import as_bits

BLOCK = 4096  # elements per program


@triton.jit
def _copy_runs_kernel(  # noqa: PLR0913 (a kernel takes its pointers, strides and constants flat)
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    run_len,
    src_page_stride,
    dst_page_stride,
    src_run_stride,
    dst_run_stride,
    src_offset,
    dst_offset,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    run = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    src_page = i
    dst_page = i
    if SRC_INDEXED:
        src_page = tl.load(src_ids_ptr + i)
    if DST_INDEXED:
        dst_page = tl.load(dst_ids_ptr + i)
    src = src_ptr + src_page.to(tl.int64) * src_page_stride + run * src_run_stride + src_offset + offs
    dst = dst_ptr + dst_page.to(tl.int64) * dst_page_stride + run * dst_run_stride + dst_offset + offs
    mask = offs < run_len
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


def _run_geometry(pool: torch.Tensor, heads: slice | None) -> tuple[int, int, int]:
    """(first head, heads moved, runs per page) for a contiguous pool."""
    num_heads = pool.shape[3]
    first, stop, step = (0, num_heads, 1) if heads is None else heads.indices(num_heads)
    if step != 1:
        raise ValueError(f"heads: step must be 1, got {step}")
    return first, max(stop - first, 0), pool.shape[1] * 2


def launch_pack(
    kv_pool: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor, heads: slice | None
) -> None:
    """packed[i] = kv_pool[page_ids[i], :, :, heads]."""
    _launch(kv_pool, page_ids, packed, heads, pool_is_src=True)


def launch_unpack(
    kv_pool: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor, heads: slice | None
) -> None:
    """kv_pool[page_ids[i], :, :, heads] = packed[i]."""
    _launch(kv_pool, page_ids, packed, heads, pool_is_src=False)


def _launch(
    pool: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor, heads: slice | None, pool_is_src: bool
) -> None:
    """Copy between pool pages ``page_ids`` and ``packed``; the pool side is the indexed one."""
    first, moved, runs = _run_geometry(pool, heads)
    num_pages = packed.shape[0]
    head_elems = pool.shape[4] * pool.shape[5]  # P * head_dim
    run_len = moved * head_elems
    if num_pages == 0 or run_len == 0:
        return
    pool_geometry = (pool.stride(0), pool.stride(2), first * head_elems)
    packed_geometry = (packed.stride(0), run_len, 0)
    src, dst = (pool, packed) if pool_is_src else (packed, pool)
    src_geo, dst_geo = (pool_geometry, packed_geometry) if pool_is_src else (packed_geometry, pool_geometry)
    grid = (num_pages, runs, triton.cdiv(run_len, BLOCK))
    _copy_runs_kernel[grid](
        as_bits(src),
        as_bits(dst),
        page_ids,
        page_ids,
        run_len,
        src_geo[0],
        dst_geo[0],
        src_geo[1],
        dst_geo[1],
        src_geo[2],
        dst_geo[2],
        SRC_INDEXED=pool_is_src,
        DST_INDEXED=not pool_is_src,
        BLOCK=BLOCK,
        num_warps=4,
    )
