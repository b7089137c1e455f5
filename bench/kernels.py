"""GPU kernel benchmark: paged decode/verify attention in GB/s of KV read, set beside the
device copy rate, dense SDPA and gather-then-SDPA measured in the same run; page
pack/unpack and KV write rates; one prefill-over-prefix shape.

    python bench/kernels.py [--quick] [--sweep] [--out results.json]

Shapes: 32 query heads, 8 kv heads, head dim 128, one layer, every sequence at length L,
pages scattered at random. Times are medians of CUDA-event timings with the L2 flushed
between runs (triton.testing.do_bench); attention, SDPA and KV writes are timed as CUDA-graph
replays, as a decode step runs them. GB/s counts K and V bytes read once.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.attention_inputs import (  # noqa: E402
    HEAD_DIM,
    KV_HEADS,
    Q_HEADS,
    attention_fn,
    kv_bytes,
    make_pool,
    verify_mask,
)
from bench.gpu_timing import copy_rate_gbps, free_bytes, gbps, time_us  # noqa: E402
from kvcore.ops import pack_pages, unpack_pages, write_kv  # noqa: E402
from kvcore.ops.triton_attention import default_splits  # noqa: E402

FP8 = torch.float8_e4m3fn
FULL = dict(
    batches=(1, 16, 64, 256),
    lengths=(1024, 8192, 32768),
    q_lens=(1, 5, 8),
    pages=(16, 64, 128),
    dtypes=(torch.bfloat16, FP8),
)
QUICK = dict(batches=(1, 64), lengths=(8192,), q_lens=(1, 8), pages=(16, 128), dtypes=(torch.bfloat16, FP8))


def dense_us(batch: int, length: int, q_len: int) -> float | None:
    need = 2 * kv_bytes(batch, length, torch.bfloat16)
    if need > 0.8 * free_bytes():
        return None
    k = torch.randn((batch, KV_HEADS, length, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn((batch, Q_HEADS, q_len, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
    mask = verify_mask(q_len, length)
    return time_us(
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), graph=True
    )


def gather_us(pool, table, batch: int, length: int, q_len: int) -> float | None:
    if 2.2 * kv_bytes(batch, length, torch.bfloat16) > 0.8 * free_bytes():
        return None
    q = torch.randn((batch, Q_HEADS, q_len, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
    mask = verify_mask(q_len, length)

    def run():
        pages = pool[table, 0]  # [batch, pages, 2, kv_heads, page, head_dim]
        kv = pages.permute(2, 0, 3, 1, 4, 5).reshape(2, batch, KV_HEADS, length, HEAD_DIM)
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, enable_gqa=True)

    return time_us(run, graph=True)


def attention_table(shapes: dict, copy_gbps: float, rows: list) -> None:
    print(
        f"\n{'kv':>4} {'page':>4} {'B':>4} {'L':>6} {'q':>2} | {'us':>9} {'GB/s':>7} "
        f"{'%copy':>5} | {'dense us':>9} {'gather us':>9} {'x gather':>8}"
    )
    baselines: dict = {}
    for dtype in shapes["dtypes"]:
        for page in shapes["pages"]:
            for batch in shapes["batches"]:
                for length in shapes["lengths"]:
                    if 2.2 * kv_bytes(batch, length, dtype) > 0.9 * free_bytes():
                        print(f"skip {dtype} B{batch} L{length}: does not fit")
                        continue
                    pool, table = make_pool(batch, length, page, dtype)
                    for q_len in shapes["q_lens"]:
                        rows.append(
                            attention_row(
                                pool, table, dtype, page, batch, length, q_len, copy_gbps, baselines
                            )
                        )
                    del pool, table
                    torch.cuda.empty_cache()


def attention_row(pool, table, dtype, page, batch, length, q_len, copy_gbps, baselines):
    us = time_us(attention_fn(pool, table, batch, length, q_len), graph=True)
    rate = gbps(kv_bytes(batch, length, dtype), us)
    key = (batch, length, q_len)
    if key not in baselines and dtype == torch.bfloat16:
        baselines[key] = (dense_us(batch, length, q_len), gather_us(pool, table, batch, length, q_len))
    dense, gather = baselines.get(key, (None, None))
    row = dict(
        kv=str(dtype).removeprefix("torch."),
        page=page,
        batch=batch,
        length=length,
        q_len=q_len,
        us=us,
        gbps=rate,
        pct_copy=100 * rate / copy_gbps,
        dense_us=dense,
        gather_us=gather,
    )
    fmt = lambda x: f"{x:9.1f}" if x is not None else f"{'-':>9}"
    speedup = f"{gather / us:8.2f}" if gather else f"{'-':>8}"
    print(
        f"{row['kv'][:4]:>4} {page:>4} {batch:>4} {length:>6} {q_len:>2} | {us:9.1f} "
        f"{rate:7.0f} {row['pct_copy']:5.1f} | {fmt(dense)} {fmt(gather)} {speedup}",
        flush=True,
    )
    return row


def sweep(rows: list) -> None:
    """Block size, warps, stages and split waves at a few shapes, for choosing defaults."""
    print("\nsweep: block_n warps stages waves -> us")
    shapes = [(torch.bfloat16, 16, 1, 32768, 1), (FP8, 16, 64, 8192, 1), (torch.bfloat16, 16, 64, 8192, 8)]
    configs = [
        (block_n, warps, stages, 2) for block_n in (32, 64, 128) for warps, stages in ((4, 2), (4, 3), (8, 3))
    ]
    for shape in shapes:
        dtype, page, batch, length, _ = shape
        pool, table = make_pool(batch, length, page, dtype)
        waves = [(64, 4, 2, 1), (64, 4, 2, 4)] if batch <= 16 else []
        for config in configs + waves:
            rows.append(sweep_row(pool, table, shape, config))
        del pool, table
        torch.cuda.empty_cache()


def sweep_row(pool, table, shape: tuple, config: tuple) -> dict:
    """One kernel setting (block_n, warps, stages, waves) at one shape (dtype, page, batch,
    length, q_len), timed and printed."""
    dtype, page, batch, length, q_len = shape
    block_n, warps, stages, wave = config
    splits = default_splits(batch * KV_HEADS, pool.device, waves=wave)
    fn = attention_fn(
        pool,
        table,
        batch,
        length,
        q_len,
        block_n=block_n,
        num_warps=warps,
        num_stages=stages,
        num_splits=splits,
    )
    us = time_us(fn, graph=True)
    rate = gbps(kv_bytes(batch, length, dtype), us)
    print(
        f"{str(dtype)[6:10]} P{page} B{batch} L{length} q{q_len}: {block_n:4d} "
        f"{warps} {stages} {wave} ({splits:2d} splits) -> {us:8.1f} us "
        f"{rate:6.0f} GB/s",
        flush=True,
    )
    return dict(
        sweep=True,
        kv=str(dtype),
        page=page,
        batch=batch,
        length=length,
        q_len=q_len,
        block_n=block_n,
        warps=warps,
        stages=stages,
        waves=wave,
        splits=splits,
        us=us,
    )


def page_moves(copy_gbps: float, rows: list) -> None:
    """pack/unpack of an 8B-shaped target group (32 layers) and KV write per layer."""
    print("\npages: 32 layers x 8 heads x hd128 bf16; 256 of 1024 pages moved")
    for page in (16, 64, 128):
        pool = torch.randn((1024, 32, 2, KV_HEADS, page, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
        ids = torch.randperm(1024, device="cuda")[:256]
        for name, fn, moved in page_move_fns(pool, ids):
            us = time_us(fn)
            rate = gbps(moved, us)
            rows.append(dict(op=name, page=page, us=us, gbps=rate))
            print(
                f"P{page:<4} {name:13s} {us:9.1f} us {rate:7.0f} GB/s {100 * rate / copy_gbps:5.1f}% of copy",
                flush=True,
            )
        del pool
    for tokens in (64, 256, 8192):
        us = write_kv_us(tokens)
        moved = 2 * 2 * tokens * KV_HEADS * HEAD_DIM * 2  # K and V, read + write
        rows.append(dict(op="write_kv", tokens=tokens, us=us))
        print(f"write_kv {tokens:5d} tokens: {us:7.1f} us {gbps(moved, us):6.0f} GB/s", flush=True)


def page_move_fns(pool: torch.Tensor, ids: torch.Tensor) -> list:
    """(name, fn, bytes read + written) of pack, unpack and a half-heads pack."""
    packed = pack_pages(pool, ids)
    moved = 2 * packed.numel() * packed.element_size()
    return [
        ("pack", lambda: pack_pages(pool, ids), moved),
        ("unpack", lambda: unpack_pages(pool, ids, packed), moved),
        ("pack 4 heads", lambda: pack_pages(pool, ids, heads=slice(0, 4)), moved / 2),
    ]


def write_kv_us(tokens: int) -> float:
    """One layer's K/V write of ``tokens`` tokens into scattered slots."""
    pool = torch.randn((4096, 1, 2, KV_HEADS, 16, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
    kv = torch.randn((2, tokens, KV_HEADS, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(4096 * 16, device="cuda")[:tokens]
    return time_us(lambda: write_kv(pool, 0, kv[0], kv[1], slots), graph=True)


def prefill_rows(rows: list) -> None:
    """A 2K-token chunk over a 6K cached prefix (L = 8K), against causal dense SDPA."""
    print("\nprefill over prefix: B=1, chunk 2048, L=8192, bf16, page 16")
    chunk, length = 2048, 8192
    pool, table = make_pool(1, length, 16, torch.bfloat16)
    us = time_us(attention_fn(pool, table, 1, length, chunk))
    visible = chunk * (length - chunk) + chunk * (chunk + 1) / 2
    tflops = 4 * visible * Q_HEADS * HEAD_DIM / us / 1e6
    k = torch.randn((1, KV_HEADS, length, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
    q = torch.randn((1, Q_HEADS, chunk, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
    mask = verify_mask(chunk, length)
    dense = time_us(lambda: F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True))
    rows.append(dict(op="prefill", us=us, tflops=tflops, dense_us=dense))
    print(f"kernel {us:8.1f} us ({tflops:5.1f} TFLOP/s); dense masked SDPA {dense:8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small subset of shapes")
    parser.add_argument("--sweep", action="store_true", help="also sweep kernel settings")
    parser.add_argument("--out", type=Path, help="write every figure as JSON")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_gbps = copy_rate_gbps()
    print(f"{torch.cuda.get_device_name()}: device copy {copy_gbps:.0f} GB/s (read + write)")
    rows: list = [dict(op="copy", gbps=copy_gbps)]
    try:
        if args.sweep:
            sweep(rows)
        page_moves(copy_gbps, rows)
        prefill_rows(rows)
        attention_table(QUICK if args.quick else FULL, copy_gbps, rows)
    finally:
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1, default=str))
    best = max((r for r in rows if "pct_copy" in r), key=lambda r: r["gbps"], default=None)
    if best and math.isfinite(best["gbps"]):
        print(f"\nbest: {best['gbps']:.0f} GB/s ({best['pct_copy']:.1f}% of copy)")


if __name__ == "__main__":
    main()
