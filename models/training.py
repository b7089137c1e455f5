"""The optimisation pieces both phases of ``train_tiny`` share.

Weights start at N(0, 0.02), residual outputs scaled by 1/sqrt(2L); AdamW decays matrices
only; the learning rate warms up over the first 5% of a phase's progress, then follows a
cosine down to a tenth of its base; progress is the larger of the step and time fractions
of a ``Budget``. CUDA runs under bf16 autocast, CPU in float32.
"""

from __future__ import annotations

import math
import time

import torch


def init_weights(model: torch.nn.Module, num_layers: int, seed: int) -> None:
    """N(0, 0.02) for matrices and embeddings; residual outputs scaled by 1/sqrt(2L)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        std = (
            0.02 / math.sqrt(2 * num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        )
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


def lr_at(progress: float, base: float, warmup: float = 0.05) -> float:
    if progress < warmup:
        return base * progress / warmup
    t = min(1.0, (progress - warmup) / (1 - warmup))
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


class Budget:
    """Progress in [0, 1]: the larger of steps / max_steps and seconds / max_seconds."""

    def __init__(self, max_steps: int, max_seconds: float) -> None:
        self.max_steps, self.max_seconds, self.start = max_steps, max_seconds, time.time()

    def progress(self, step: int) -> float:
        by_time = (time.time() - self.start) / self.max_seconds if self.max_seconds > 0 else 0.0
        by_steps = step / self.max_steps if self.max_steps > 0 else 0.0
        return max(by_time, by_steps)


def autocast(device: str):
    return (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.startswith("cuda")
        else torch.autocast("cpu", enabled=False)
    )
