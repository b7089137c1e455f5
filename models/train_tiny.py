"""Train the tiny byte-level pair on the Python standard library source.

    python -m models.train_tiny --out DIR [--device cuda] [--target-seconds S] ...

Phase 1 trains the target (next-byte cross-entropy). Phase 2 freezes it and trains the
EAGLE-3 drafter on its hidden states: soft cross-entropy against the target's next-token
distribution at every slot, over ``--chain-steps`` chained draft steps (training-time
test, models/ttt.py), step s weighted 0.8**s. Each phase stops at its step cap or its
time budget, whichever comes first; the learning rate follows a warmup + cosine schedule
over that progress (models/training.py). Writes DIR/tiny-target, DIR/tiny-drafter (HF folders, bf16) and
DIR/train_metrics.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from models.byte_tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE, write_byte_tokenizer
from models.data import random_windows, split_files, token_stream
from models.training import Budget, autocast, init_weights, lr_at, make_optimizer
from models.ttt import DRAFT_KEY_START, ChainContext
from services.engine.models import (
    DenseContext,
    Eagle3Drafter,
    EagleConfig,
    LlamaConfig,
    LlamaForCausalLM,
    load_target,
    save_model,
)

CHAIN_DECAY = 0.8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-files", type=int, default=0, help="0 = every file")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--context", type=int, default=32768, help="max_position_embeddings")
    p.add_argument("--rope-theta", type=float, default=500000.0, help="RoPE base (config's rope_theta)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--long-seq-len", type=int, default=32768, help="target windows of the long phase")
    p.add_argument(
        "--long-fraction",
        type=float,
        default=0.3,
        help="last fraction of the target's progress on --long-seq-len windows (same tokens a step)",
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--target-steps", type=int, default=0, help="0 = time-bound only")
    p.add_argument("--target-seconds", type=float, default=170.0)
    p.add_argument("--target-from", default="", help="train only a drafter, for the target folder given here")
    p.add_argument("--drafter-name", default="tiny-drafter", help="the drafter's folder under --out")
    p.add_argument("--window", type=int, default=256, help="drafter sliding window")
    p.add_argument("--draft-seq-len", type=int, default=1024)
    p.add_argument("--draft-batch", type=int, default=32)
    p.add_argument("--draft-lr", type=float, default=2e-3)
    p.add_argument("--chain-steps", type=int, default=4)
    p.add_argument("--drafter-steps", type=int, default=0, help="0 = time-bound only")
    p.add_argument("--drafter-seconds", type=float, default=90.0)
    p.add_argument("--eval-windows", type=int, default=64)
    return p.parse_args(argv)


def target_config(a: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=a.context,
        rope_theta=a.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )


def drafter_config(a: argparse.Namespace, target: LlamaConfig) -> EagleConfig:
    n = target.num_hidden_layers
    return EagleConfig(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        max_position_embeddings=target.max_position_embeddings,
        rope_theta=target.rope_theta,
        sliding_window=a.window,
        aux_layer_ids=(min(1, n - 1), n // 2, n - 1),
    )


def dense_forward(target: LlamaForCausalLM, ids: torch.Tensor, aux_layer_ids=()):
    b, t = ids.shape
    positions = torch.arange(t, device=ids.device).repeat(b)
    return target(ids.reshape(-1), positions, DenseContext(b, t), aux_layer_ids)


def target_loss(target: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """windows [batch, seq_len + 1] -> mean next-token cross-entropy (nats)."""
    out = dense_forward(target, windows[:, :-1])
    logits = target.head(out.hidden).float()  # [batch * seq_len, vocab]
    return F.cross_entropy(logits, windows[:, 1:].reshape(-1))


def window_shape(progress: float, batch: int, length: int, long_length: int, long_fraction: float):
    """(windows, tokens a window) at ``progress``: the long phase keeps the tokens a step."""
    if long_length <= length or progress < 1.0 - long_fraction:
        return batch, length
    return max(1, batch * length // long_length), long_length


def train_loop(model, loss_fn, stream, a, shape, lr, budget, label) -> dict:
    """``shape(progress)`` -> (windows, tokens a window) of each step's batch."""
    opt = make_optimizer(model, lr)
    gen = torch.Generator().manual_seed(a.seed + 1)
    step, losses, tokens = 0, [], 0
    while (progress := budget.progress(step)) < 1.0:
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, lr)
        batch, length = shape(progress)
        tokens += batch * length
        windows = random_windows(stream, batch, length, gen).to(a.device)
        with autocast(a.device):
            loss = loss_fn(windows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or step == 1:
            losses.append((step, round(loss.item(), 4)))
            print(
                f"{label} step {step} len {length} loss {loss.item():.4f} "
                f"t {time.time() - budget.start:.0f}s",
                flush=True,
            )
    return {
        "steps": step,
        "seconds": round(time.time() - budget.start, 1),
        "tokens": tokens,
        "loss_curve": losses,
        "final_loss": losses[-1][1] if losses else None,
    }


def drafter_loss(
    drafter: Eagle3Drafter, target: LlamaForCausalLM, windows: torch.Tensor, window: int, chain_steps: int
) -> tuple[torch.Tensor, list[float]]:
    """Weighted soft cross-entropy over chain steps, and per-step top-1 agreement with
    the target. windows [batch, seq_len]; slot i at step s predicts the target's
    distribution at position i, valid for i >= s."""
    b, t = windows.shape
    ids = windows.reshape(-1)
    positions = torch.arange(t, device=ids.device).repeat(b)
    with torch.no_grad():
        out = dense_forward(target, windows, drafter.config.aux_layer_ids)
        p = torch.softmax(target.head(out.hidden).float(), dim=-1)  # [b * t, vocab]
    hidden = shift_right(drafter.project(out.aux), b, t)  # h_i = f_{i-1}
    ctx = ChainContext(b, t, window)
    total, accs = 0.0, []
    valid = torch.arange(t, device=ids.device).repeat(b)
    for s in range(chain_steps):
        g = drafter(ids, hidden, positions, ctx, target)
        logq = torch.log_softmax(drafter.compute_logits(g, target), dim=-1)
        keep = valid >= s + DRAFT_KEY_START  # chains from slot 0 have no exact key
        ce = -(p[keep] * logq[keep]).sum(-1).mean()
        total = total + CHAIN_DECAY**s * ce
        accs.append((logq[keep].argmax(-1) == p[keep].argmax(-1)).float().mean().item())
        hidden = shift_right(g, b, t)  # h_i = g_{i-1}
    return total, accs


def shift_right(x: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """[batch * seq_len, d]: row i of each sequence gets row i - 1, zeros at i = 0."""
    x3 = x.view(batch, seq_len, -1)
    return F.pad(x3, (0, 0, 1, 0))[:, :seq_len].reshape(x.shape)


@torch.no_grad()
def eval_target(target: LlamaForCausalLM, stream: torch.Tensor, a) -> float:
    """Held-out bits per byte over ``eval_windows`` random windows of seq_len bytes."""
    gen = torch.Generator().manual_seed(a.seed + 7)
    losses = []
    for _ in range(max(1, a.eval_windows // 8)):
        windows = random_windows(stream, 8, a.seq_len + 1, gen).to(a.device)
        with autocast(a.device):
            losses.append(target_loss(target, windows).item())
    return sum(losses) / len(losses) / math.log(2)


@torch.no_grad()
def eval_target_by_position(target: LlamaForCausalLM, stream: torch.Tensor, a) -> dict[str, float]:
    """Held-out bits per byte of ``--long-seq-len`` windows, by position: "lo-hi" -> the
    mean over positions [lo, hi) (powers of two from 1,024), so a model that stops using or
    breaks on far context shows it in the last buckets."""
    gen = torch.Generator().manual_seed(a.seed + 9)
    n = a.long_seq_len
    edges = [0] + [1 << e for e in range(10, n.bit_length()) if 1 << e < n] + [n]
    sums = torch.zeros(len(edges) - 1, dtype=torch.float64)
    for _ in range(max(1, a.eval_windows // 16)):
        w = random_windows(stream, 1, n + 1, gen).to(a.device)
        with autocast(a.device):
            logits = target.head(dense_forward(target, w[:, :-1]).hidden).float()
        nats = F.cross_entropy(logits.float(), w[0, 1:], reduction="none").cpu()  # [n]
        sums += torch.stack([nats[lo:hi].mean() for lo, hi in zip(edges, edges[1:], strict=False)])
    bits = sums / max(1, a.eval_windows // 16) / math.log(2)
    return {f"{lo}-{hi}": round(b.item(), 4) for lo, hi, b in zip(edges, edges[1:], bits, strict=False)}


@torch.no_grad()
def eval_drafter(drafter, target, stream: torch.Tensor, a) -> list[float]:
    gen = torch.Generator().manual_seed(a.seed + 8)
    rows = []
    for _ in range(max(1, a.eval_windows // 8)):
        windows = random_windows(stream, 8, a.draft_seq_len, gen).to(a.device)
        with autocast(a.device):
            rows.append(drafter_loss(drafter, target, windows, a.window, a.chain_steps)[1])
    return [round(sum(c) / len(c), 4) for c in zip(*rows, strict=True)]


def load_streams(a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The training and held-out byte streams on ``a.device``, and the metrics naming them."""
    train_files, held_files = split_files(max_files=a.max_files)
    train, held = token_stream(train_files).to(a.device), token_stream(held_files).to(a.device)
    print(
        f"train {len(train_files)} files {len(train)} bytes; held out {len(held_files)} "
        f"files {len(held)} bytes",
        flush=True,
    )
    metrics = {
        "args": vars(a),
        "train_files": len(train_files),
        "train_bytes": len(train),
        "held_out_files": len(held_files),
        "held_out_bytes": len(held),
    }
    return train, held, metrics


def train_target(a: argparse.Namespace, train: torch.Tensor, held: torch.Tensor, metrics: dict):
    """Phase 1: the target from scratch; returns it frozen, its metrics in ``metrics``."""
    tc = target_config(a)
    target = LlamaForCausalLM(tc)
    init_weights(target, tc.num_hidden_layers, a.seed)
    target.to(a.device).train()
    metrics["target"] = train_loop(
        target,
        lambda w: target_loss(target, w),
        train,
        a,
        lambda progress: window_shape(progress, a.batch, a.seq_len + 1, a.long_seq_len + 1, a.long_fraction),
        a.lr,
        Budget(a.target_steps, a.target_seconds),
        "target",
    )
    target.eval().requires_grad_(False)
    metrics["target"]["held_out_bits_per_byte"] = round(eval_target(target, held, a), 4)
    metrics["target"]["held_out_bits_per_byte_by_position"] = eval_target_by_position(target, held, a)
    return target


def train_drafter(a: argparse.Namespace, target, train: torch.Tensor, held: torch.Tensor, metrics: dict):
    """Phase 2: the drafter on the frozen target; its metrics in ``metrics``."""
    dc = drafter_config(a, target.config)
    drafter = Eagle3Drafter(dc)
    init_weights(drafter, 1, a.seed + 2)
    drafter.to(a.device).train()
    loss_fn = lambda w: drafter_loss(drafter, target, w, a.window, a.chain_steps)[0]
    metrics["drafter"] = train_loop(
        drafter,
        loss_fn,
        train,
        a,
        lambda progress: (a.draft_batch, a.draft_seq_len),
        a.draft_lr,
        Budget(a.drafter_steps, a.drafter_seconds),
        "drafter",
    )
    drafter.eval()
    metrics["drafter"]["held_out_top1_per_step"] = eval_drafter(drafter, target, held, a)
    return drafter


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(a.out)
    train, held, metrics = load_streams(a)
    if a.target_from:
        target = load_target(a.target_from, a.device).requires_grad_(False)
    else:
        target = train_target(a, train, held, metrics)
        save_model(target, out / "tiny-target")
        write_byte_tokenizer(out / "tiny-target")
        print(json.dumps({k: v for k, v in metrics["target"].items() if k != "loss_curve"}), flush=True)
    drafter = train_drafter(a, target, train, held, metrics)
    save_model(drafter, out / a.drafter_name)
    name = "train_metrics.json" if not a.target_from else f"train_metrics_{a.drafter_name}.json"
    (out / name).write_text(json.dumps(metrics, indent=1) + "\n")
    print(json.dumps({k: v for k, v in metrics["drafter"].items() if k != "loss_curve"}))


if __name__ == "__main__":
    main()
