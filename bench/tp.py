"""Tensor parallelism on two GPUs: TP 2 decodes what TP 1 decodes, and the KV transfer
between the two GPUs against the raw rate between them.

    python -m bench.tp decode     # an 8B-shaped random target (float32), TP 1 then TP 2 (NCCL)
    python -m bench.tp transfer   # 8B-shaped pages GPU 0 -> GPU 1 over UCX, vs raw UCX and
                                  # a device-to-device copy
    --toy: tiny shapes on the CPU (gloo, shared memory), to check the script anywhere.

Weights are random but deterministic per tensor name (the same on every rank, each of
which keeps its slices with ``shard_state_dict``), in float32 so that greedy argmaxes
do not hinge on bf16 rounding of the all-reduce.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
import zlib

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import torch  # noqa: E402

from services.engine.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from services.engine.parallel import SINGLE, TensorParallel, shard_state_dict  # noqa: E402

PAGE = 16


def llama_8b() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    )


def toy() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


# ---------------------------------------------------------------- decode: TP 2 vs TP 1


def seeded(name: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """The whole checkpoint tensor ``name``: norms near 1, the rest N(0, 1 / fan_in)."""
    gen = torch.Generator(device).manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=gen, device=device)
    if name.endswith("norm.weight"):
        return 1 + 0.1 * t
    return t if name.endswith("embed_tokens.weight") else t / shape[-1] ** 0.5


def random_target(
    config: LlamaConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel = SINGLE
) -> LlamaForCausalLM:
    """This rank's shards of the seeded checkpoint, made on ``device``."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config, tp)
    finally:
        torch.set_default_dtype(before)
    with torch.no_grad():
        for name, param in model.state_dict().items():
            whole = seeded(name, shapes[name], device)
            param.copy_(shard_state_dict(model, {name: whole})[name])
    return model.eval()


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (16, 200, 1000)]


def decode(config: LlamaConfig, device: str, tp_size: int, max_tokens: int) -> dict:
    """Greedy outputs of this process's engine (rank 0) and seconds per output token."""
    import services.engine.engine as engine_module
    from services.engine import Engine, EngineConfig, SamplingParams

    engine_module.load_target = lambda folder, dev, dtype, tp: random_target(config, dev, dtype, tp)
    engine = Engine(
        EngineConfig(
            model="random-8b",
            drafter=None,
            num_spec_tokens=0,
            device=device,
            dtype="float32",
            kv_cache_bytes=2 << 30,
            max_num_seqs=4,
            enforce_eager=True,
            tp_size=tp_size,
        )
    )
    if engine.tp.rank > 0:
        from services.engine.lockstep import follow

        follow(engine.runner, engine.tp)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate([prompts(config.vocab_size)[0]], greedy)  # warm-up
    start = time.perf_counter()
    outs = [engine.generate([p], greedy)[0] for p in prompts(config.vocab_size)]
    seconds = time.perf_counter() - start
    return {"tokens": [o.token_ids for o in outs], "s_per_token": seconds / (3 * max_tokens)}


def _decode_rank(rank: int, address: str, toy_shapes: bool, max_tokens: int, conn) -> None:
    from services.engine.parallel import init_tensor_parallel

    config = toy() if toy_shapes else llama_8b()
    device = "cpu" if toy_shapes else "cuda"
    reference = decode(config, device, 1, max_tokens) if rank == 0 else None
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    init_tensor_parallel(2, rank, address, "gloo" if toy_shapes else "nccl", device)
    tp2 = decode(config, device, 2, max_tokens)
    conn.send({"tp1": reference, "tp2": tp2})


def run_decode(toy_shapes: bool, max_tokens: int) -> dict:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    parent, child = ctx.Pipe()
    procs = [
        ctx.Process(target=_decode_rank, args=(r, address, toy_shapes, max_tokens, child), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        got = parent.recv()
    finally:
        for p in procs:
            p.kill()
    same = got["tp1"]["tokens"] == got["tp2"]["tokens"]
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
        for x, y in zip(got["tp1"]["tokens"], got["tp2"]["tokens"], strict=True)
    ]
    return {
        "same_tokens": same,
        "first_difference": first_diff,
        "tokens_per_prompt": max_tokens,
        "tp1_ms_per_token": 1e3 * got["tp1"]["s_per_token"],
        "tp2_ms_per_token": 1e3 * got["tp2"]["s_per_token"],
    }


# ---------------------------------------------------------------- transfer between GPUs


def cache(num_tokens: int, kv_heads: int):
    """8B-shaped KV: 32 layers, ``kv_heads`` heads of 128, bf16, 16-token pages (2 MiB a
    page at 8 heads) and a 1-layer drafter with a 512-token window."""
    from kvcore import CacheConfig, LayerGroupSpec, Lifecycle, Owner

    target = LayerGroupSpec("target", Owner.TARGET, 32, kv_heads, 128, dtype="bfloat16")
    draft = LayerGroupSpec(
        "draft", Owner.DRAFT, 1, kv_heads, 128, dtype="bfloat16", window=512, lifecycle=Lifecycle.OPTIONAL
    )
    pages = num_tokens // PAGE + 8
    return CacheConfig(
        groups=(target, draft), tokens_per_page=PAGE, num_pages=(pages, pages), num_spec_tokens=4
    )


def _transfer_side(side: str, num_tokens: int, raw_bytes: int, repeats: int, device: str, conn) -> None:
    asyncio.run(_transfer_session(side, num_tokens, raw_bytes, repeats, device, conn))


async def _transfer_session(
    side: str, num_tokens: int, raw_bytes: int, repeats: int, device: str, conn
) -> None:
    from kvcore import KVCacheManager
    from kvcore.transfer.head_routes import HeadRoute
    from kvcore.transfer.kv_transfer import AuxState, KVTransferAgent
    from kvcore.transfer.ucx import UcxEndpointInfo, UcxTransport

    dev = torch.device(device)
    transport = UcxTransport()
    await transport.start()
    conn.send(transport.local_info().worker_address)
    peer = "B" if side == "A" else "A"
    await transport.connect(peer, UcxEndpointInfo(await asyncio.to_thread(conn.recv)))
    results: dict[str, list[float]] = {"raw": [], "whole": [], "sliced": []}
    buffer = torch.empty(raw_bytes, dtype=torch.uint8, device=dev)
    ack = torch.zeros(8, dtype=torch.uint8)
    for i in range(repeats + 1):  # raw UCX: one message, acknowledged
        if side == "A":
            start = time.perf_counter()
            await transport.send(peer, buffer, 1000 + i, 60.0)
            await transport.recv(ack, 2000 + i, 60.0)
            results["raw"].append(time.perf_counter() - start)
        else:
            await transport.recv(buffer, 1000 + i, 60.0)
            await transport.send(peer, ack, 2000 + i, 60.0)
    whole = KVTransferAgent(KVCacheManager(cache(num_tokens, 8), dev), 4096, transport)
    half = KVTransferAgent(KVCacheManager(cache(num_tokens, 4), dev), 4096, transport)
    route = {g: HeadRoute(0, 1, slice(4, 8), slice(0, 4), False) for g in ("target", "draft")}
    aux = AuxState(num_tokens, 1, torch.zeros(4096), "A")
    for i in range(repeats + 1):
        for kind, agent in (("whole", whole), ("sliced", whole if side == "A" else half)):
            rid, m = f"{kind}-{i}", agent.manager
            if side == "A":
                m.allocate(rid, num_tokens)
                m.advance(rid, num_tokens)
                dest = await asyncio.to_thread(conn.recv)
                start = time.perf_counter()
                if kind == "whole":  # equal TP: whole pages, runs pool to pool
                    usage = await agent.send_request(rid, num_tokens, peer, aux, 60.0, dest)
                else:  # TP 1 -> 2, decode rank 1's half of the heads: packed on the GPU
                    usage = await agent.send_pages(
                        rid, m.transfer_pages(rid, num_tokens), peer, 60.0, dest, route
                    )
                    await agent.wait_ack(rid, num_tokens, 60.0)
                results[kind].append(time.perf_counter() - start)
                results[f"{kind}_bytes"] = [sum(usage.bytes.values())]
            else:
                m.allocate(rid, num_tokens, num_computed=num_tokens)
                conn.send({g: m.block_table(rid, g) for g in m.groups})
                if kind == "whole":
                    await agent.receive_request(rid, num_tokens, 60.0)
                else:
                    await agent.receive_pages(rid, m.transfer_pages(rid, num_tokens), 60.0, route)
                    await agent.acknowledge(rid, "A", num_tokens, 60.0)
            m.free(rid)
    if side == "A":
        results["peer_copy"] = _peer_copy_seconds(raw_bytes, repeats) if dev.type == "cuda" else []
        conn.send(results)
    await transport.close()


def _peer_copy_seconds(nbytes: int, repeats: int) -> list[float]:
    """torch device-to-device copy, GPU 0 -> GPU 1 (CUDA events)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize("cuda:1")
        times.append(time.perf_counter() - start)
    return times[1:]


def run_transfer(toy_shapes: bool, num_tokens: int, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    pipes = {s: ctx.Pipe() for s in "AB"}
    raw_bytes = 256 << 20
    devices = {"A": "cpu", "B": "cpu"} if toy_shapes else {"A": "cuda:0", "B": "cuda:1"}
    procs = {
        s: ctx.Process(
            target=_transfer_side,
            args=(s, num_tokens, raw_bytes, repeats, devices[s], pipes[s][1]),
            daemon=True,
        )
        for s in "AB"
    }
    for p in procs.values():
        p.start()
    a, b = pipes["A"][0], pipes["B"][0]
    address_a, address_b = a.recv(), b.recv()
    a.send(address_b)
    b.send(address_a)
    for _ in range(2 * (repeats + 1)):  # reservation rows, B -> A
        a.send(b.recv())
    got = a.recv()
    for p in procs.values():
        p.join(timeout=30)
    rate = lambda n, ts: n / statistics.median(ts[1:] if len(ts) > 1 else ts) / 1e9  # noqa: E731
    out = {
        "prompt_tokens": num_tokens,
        "raw_ucx_GBps": rate(raw_bytes, got["raw"]),
        "whole_pages_GBps": rate(got["whole_bytes"][0], got["whole"]),
        "whole_pages_bytes": got["whole_bytes"][0],
        "sliced_heads_GBps": rate(got["sliced_bytes"][0], got["sliced"]),
        "sliced_heads_bytes": got["sliced_bytes"][0],
    }
    if got["peer_copy"]:
        out["device_copy_GBps"] = raw_bytes / statistics.median(got["peer_copy"]) / 1e9
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["decode", "transfer"])
    p.add_argument("--toy", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if a.toy:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if a.what == "decode":
        print(json.dumps(run_decode(a.toy, a.max_tokens), indent=1), flush=True)
    else:
        print(json.dumps(run_transfer(a.toy, a.prompt_tokens, a.repeats), indent=1), flush=True)


if __name__ == "__main__":
    main()
