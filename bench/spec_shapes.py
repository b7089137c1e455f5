"""Speculative step cost at Llama-3.1-8B shapes: ``python -m bench.spec_speedup --shape 8b``.

Target: Llama-3.1-8B-shaped (32 layers, hidden 4096, 32/8 heads, MLP 14336, vocab 128256,
untied head). Drafter: EAGLE-3-shaped (1 layer over [embedding, hidden] 8192 wide, hidden
4096, draft vocabulary 32,000 mapped by ``d2t``, aux layers 1, 15, 28 of the target). Random
weights made on the GPU, bf16; the loader is bypassed (nothing is read from disk but a
byte tokenizer: token ids only). Every request decodes ``--max-tokens`` after a random
prompt of ``--prompt-len`` tokens; the verifier keeps exactly AL - 1 drafts per step
(``forced_acceptance``, benchmarks only), so step time is measured at a chosen AL;
``--repeats R`` keeps the median of R runs of each. Adaptive
K is off, so every step drafts. ``--draft-quantization fp8``: the drafter's own weights in
e4m3 (the roofline then counts their fp8 bytes where a matmul reads them: up to FP8_ROWS
rows).

A second, synchronized run of each configuration splits its steps into the phases of
``bench.decode_run.PHASES`` and the rest (host work, sampling, acceptance).

Roofline of a step: bytes it must read (every weight matrix it multiplies by, once per
forward: the target once, the drafter's layer K times (once in the catch-up stage over
K + 1 rows per request, K - 1 times in the chain) and its head K times, ``fc`` once; KV of
the context, target and drafter) over the copy rate measured in the run.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

import services.engine.engine as engine_module
from bench.decode_inputs import build_target, llama_8b
from bench.decode_run import PHASES, decode_run, host_profile, print_phases, timed_phases
from models.byte_tokenizer import write_byte_tokenizer
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.models import Eagle3Drafter, EagleConfig, LlamaConfig, LlamaForCausalLM
from services.engine.models.config import write_config_json
from services.engine.models.fp8 import FP8_ROWS, Fp8Linear, Fp8Weight

VOCAB, DRAFT_VOCAB = 128256, 32000


def eagle3_8b() -> EagleConfig:
    return EagleConfig(
        vocab_size=VOCAB,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        draft_vocab_size=DRAFT_VOCAB,
        aux_layer_ids=(1, 15, 28),
    )


def random_target(config: LlamaConfig) -> LlamaForCausalLM:
    model = build_target(config, torch.device("cuda"), torch.bfloat16)
    model.merge_projections()
    return model


def random_drafter(config: EagleConfig) -> Eagle3Drafter:
    torch.manual_seed(1)
    with torch.device("cuda"):
        drafter = Eagle3Drafter(config)
    drafter = drafter.to(torch.bfloat16).eval()
    drafter.d2t.copy_(torch.randint(0, VOCAB - DRAFT_VOCAB, (DRAFT_VOCAB,)).sort().values)
    drafter.merge_projections()
    return drafter


@contextlib.contextmanager
def random_models() -> Iterator[str]:
    """A model folder name whose loads build the random 8B target and drafter."""
    saved = engine_module.load_target, engine_module.load_drafter
    engine_module.load_target = lambda folder, device, dtype, tp: random_target(llama_8b(VOCAB))
    engine_module.load_drafter = lambda folder, device, dtype, tp: random_drafter(eagle3_8b())
    with tempfile.TemporaryDirectory() as folder:
        write_config_json(folder, llama_8b(VOCAB))
        write_byte_tokenizer(Path(folder))
        try:
            yield folder
        finally:
            engine_module.load_target, engine_module.load_drafter = saved


def make_engine(folder: str, k: int, max_batch: int, kv_bytes: int, draft_quantization: str = "") -> Engine:
    return Engine(
        EngineConfig(
            model=folder,
            drafter=folder if k else None,
            num_spec_tokens=k,
            device="cuda",
            enable_prefix_cache=False,
            max_num_seqs=max_batch,
            kv_cache_bytes=kv_bytes,
            max_num_batched_tokens=4096,
            max_prefill_chunk=4096,
            adaptive_k=False,
            forced_acceptance=0 if k else -1,
            unsafe_forced_acceptance=bool(k),
            draft_quantization=draft_quantization if k else "",
        )
    )


def copy_rate_gbs() -> float:
    """Device-to-device copy rate, bytes read + written, GB/s (median of 10)."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * src.numel() / (sorted(times[2:])[5] * 1e-3) / 1e9


def matrix_bytes(module: torch.nn.Module, skip: tuple[str, ...] = (), rows: int = 1) -> int:
    """Bytes of the module's 2-D weights (what its matmuls stream over ``rows`` rows), fp8
    ones included (with their scales, or their dense copy past FP8_ROWS rows), skipped names
    aside."""
    plain = sum(
        p.numel() * p.element_size()
        for n, p in module.named_parameters()
        if p.dim() == 2 and not any(s in n for s in skip)
    )
    fp8 = sum(
        fp8_bytes(m.weight, rows)
        for n, m in module.named_modules(remove_duplicate=False)
        if isinstance(m, Fp8Linear) and not any(s in n for s in skip)
    )
    return plain + fp8


def fp8_bytes(w: Fp8Weight, rows: int) -> int:
    if w.dense is not None and rows > FP8_ROWS:
        return w.dense.numel() * w.dense.element_size()
    return w.data.numel() + 4 * w.scale.numel()


def kv_bytes_per_token(layers: int, kv_heads: int = 8, head_dim: int = 128) -> int:
    return layers * 2 * kv_heads * head_dim * 2  # K and V, bf16


def step_rooflines(engine: Engine, batch: int, context: int, rate_gbs: float) -> tuple[float, float]:
    """(target-only ms, speculative ms) a step must take at ``rate_gbs`` (see the module
    docstring); ``context`` is the mean context length over the run."""
    target = matrix_bytes(engine.target, skip=("embed_tokens",))
    target_kv = batch * context * kv_bytes_per_token(engine.target.config.num_hidden_layers)
    base = target + target_kv
    spec = base
    if engine.drafter is not None:
        d, k, widened = engine.drafter, engine.k, batch * (engine.k + 1)
        layer = lambda rows: matrix_bytes(d, ("lm_head", "fc.", "embed_tokens"), rows)  # noqa: E731
        spec += matrix_bytes(d.fc, rows=widened) + layer(widened)  # the catch-up stage: K + 1 rows each
        spec += (k - 1) * layer(batch) + k * matrix_bytes(d.lm_head, rows=batch)
        spec += k * batch * context * kv_bytes_per_token(1)
    return 1e3 * base / (rate_gbs * 1e9), 1e3 * spec / (rate_gbs * 1e9)


def random_prompts(batch: int, prompt_len: int) -> list[list[int]]:
    """``batch`` prompts of ``prompt_len`` random ids, seeded by the batch size."""
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(0, 32000, (prompt_len,), generator=g).tolist() for _ in range(batch)]


def timed_runs(
    engines: dict[tuple[int, str], Engine], batch: int, als: list[int], lengths: tuple[int, int], repeats: int
) -> dict[tuple[int, str, int], dict]:
    """{(K, quantization, AL): the median of ``repeats`` decode runs} at ``batch``, every
    engine and AL taking turns in each repeat, so that a slow spell of the host or the
    device falls on all of them; AL 0: without forcing (target-only)."""
    prompts = random_prompts(batch, lengths[0])
    turns = [(key, al) for key in engines for al in (als if key[0] else [0])]
    for key, _ in turns:
        decode_run(engines[key], prompts, lengths[1])  # warm-up: eager shapes compile here
    runs: dict[tuple[int, str, int], list[dict]] = {(*key, al): [] for key, al in turns}
    for _ in range(repeats):
        for key, al in turns:
            engines[key].config.forced_acceptance = al - 1 if al else -1
            runs[(*key, al)].append(decode_run(engines[key], prompts, lengths[1]))
    return {t: sorted(r, key=ms_per_step)[len(r) // 2] for t, r in runs.items()}


def ms_per_step(run: dict) -> float:
    return run["ms_per_step"]


def phase_split(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """ms per decode step in each phase of ``bench.decode_run.PHASES`` and the rest, from a
    second, synchronized run."""
    spent, undo = timed_phases(engine, "cuda")
    try:
        split = decode_run(engine, prompts, max_tokens, spent)
    finally:
        undo()
    phases = {n: 1e3 * spent.get(n, 0.0) / split["steps"] for n in PHASES}
    phases["rest"] = split["ms_per_step"] - sum(phases.values())
    return {n: round(v, 3) for n, v in phases.items()}


def main_8b(
    batches: list[int], ks: list[int], als: list[int], lengths: tuple[int, int], a: argparse.Namespace
) -> list[dict]:
    """Target-only and each (K, draft quantization) at each forced AL, all engines alive at
    once and measured in turns (``timed_runs``); prints the table, returns its rows. ``a``:
    ``repeats``, ``host_profile`` (N > 0: each engine's host profile at each batch, last
    AL) and ``quantizations``."""
    rate = copy_rate_gbs()
    context = lengths[0] + lengths[1] // 2
    kv, rows = 8 << 30, []
    with random_models() as folder:
        engines = {(0, ""): make_engine(folder, 0, max(batches), kv)}
        for k, q in ((k, q) for k in ks for q in a.quantizations):
            engines[k, q] = make_engine(folder, k, max(batches), kv, q)
        for b in batches:
            timed = timed_runs(engines, b, als, lengths, a.repeats)
            prompts = random_prompts(b, lengths[0])
            base, base_phases = timed[0, "", 0], phase_split(engines[0, ""], prompts, lengths[1])
            base_roof = step_rooflines(engines[0, ""], b, context, rate)[0]
            for (k, q, al), r in timed.items():
                if not k:
                    continue
                engine = engines[k, q]
                engine.config.forced_acceptance = al - 1
                rows.append(
                    dict(k=k, al=al, batch=b, draft_quantization=q, base_ms=base["ms_per_step"],
                         spec_ms=r["ms_per_step"], base_roof=base_roof,
                         spec_roof=step_rooflines(engine, b, context, rate)[1],
                         base_tok_s=base["tok_s"], spec_tok_s=r["tok_s"], base_phases_ms=base_phases,
                         spec_phases_ms=phase_split(engine, prompts, lengths[1]))
                )  # fmt: skip
            if a.host_profile:
                for (k, q), engine in engines.items():
                    print(f"\nhost profile, K {k} {q or 'bf16'}, B{b}:", flush=True)
                    print(host_profile(engine, prompts, lengths[1], a.host_profile), flush=True)
        del engines
        torch.cuda.empty_cache()
    print_8b(rows, rate)
    return rows


def print_8b(rows: list[dict], rate: float) -> None:
    print(f"\ncopy rate {rate:,.0f} GB/s")
    print(
        "| K | drafter | AL | B | target-only ms | x roofline | spec ms | x roofline | spec / target-only "
        "| target-only tok/s | spec tok/s | speedup | speedup roofline |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ideal = r["al"] * r["base_roof"] / r["spec_roof"]
        print(
            f"| {r['k']} | {r['draft_quantization'] or 'bf16'} | {r['al']} | {r['batch']} "
            f"| {r['base_ms']:.2f} | {r['base_ms'] / r['base_roof']:.2f} "
            f"| {r['spec_ms']:.2f} | {r['spec_ms'] / r['spec_roof']:.2f} | {r['spec_ms'] / r['base_ms']:.2f} "
            f"| {r['base_tok_s']:,.0f} | {r['spec_tok_s']:,.0f} | {r['spec_tok_s'] / r['base_tok_s']:.2f} "
            f"| {ideal:.2f} |"
        )
    print_phases(rows, lambda r: f"K{r['k']} {r['draft_quantization'] or 'bf16'} AL{r['al']} B{r['batch']}")
