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
import json
import multiprocessing as mp
import os
import socket
import time
import zlib

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import torch  # noqa: E402

from bench.tp_transfer import run_transfer  # noqa: E402
from services.engine.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from services.engine.parallel import SINGLE, TensorParallel, shard_state_dict  # noqa: E402


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
