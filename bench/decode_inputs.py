"""The decode-step benchmark's inputs: an 8B-shaped (or toy) Llama target with random
weights made on the device, a KV pool of scattered random 16-token pages, and one step's
host-side batch (one token per sequence at position context - 1)."""

from __future__ import annotations

import torch

from kvcore.spec import cdiv
from services.engine.device.cuda_graphs import UniformBatch
from services.engine.models import LlamaConfig, LlamaForCausalLM

PAGE = 16


def llama_8b(vocab: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    )


def toy(vocab: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def build_target(config: LlamaConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """Random weights (the modules' own initialisation), made directly on ``device``."""
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    return model.to(dtype).eval()


def make_pool(
    config: LlamaConfig, max_batch: int, context: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random KV pool and a block table [max_batch, pages per sequence] of scattered
    pages."""
    pages_per_seq = cdiv(context, PAGE)
    num_pages = max_batch * pages_per_seq
    pool = torch.empty(
        (num_pages, config.num_hidden_layers, 2, config.num_key_value_heads, PAGE, config.head_dim),
        dtype=dtype,
        device=device,
    )
    for chunk in pool.split(256):
        chunk.normal_()
    table = torch.randperm(num_pages, dtype=torch.int32).view(max_batch, pages_per_seq)
    return pool, table


def step_batch(table: torch.Tensor, batch: int, context: int, vocab: int) -> UniformBatch:
    """Host-side inputs: one token per sequence at position context - 1."""
    rows = table[:batch]
    pos = context - 1
    slots = rows[:, pos // PAGE].long() * PAGE + pos % PAGE
    ids = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(batch))
    return UniformBatch(
        ids, torch.full((batch,), pos), (slots,), (rows,), torch.full((batch,), context, dtype=torch.int32)
    )
