"""Tiny random checkpoints in HF format, and engines over them.

The random pair is built to be "peaked": large embeddings make logits far apart, so greedy
argmaxes are robust to the float differences between batch shapes, and a small vocabulary
makes the drafter's guesses agree with the target often enough to exercise acceptance.
"""

from __future__ import annotations

from pathlib import Path

import torch

from models.byte_tokenizer import write_byte_tokenizer
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.models import Eagle3Drafter, EagleConfig, LlamaConfig, LlamaForCausalLM, save_model
from services.engine.sampling.params import SamplingParams

VOCAB = 32
WINDOW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def target_config(vocab: int = VOCAB) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=vocab - 1,
        rope_theta=500.0,
    )


def drafter_config(window: int = WINDOW, vocab: int = VOCAB, draft_vocab: int = 0) -> EagleConfig:
    return EagleConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=500.0,
        sliding_window=window,
        aux_layer_ids=(0, 1, 2),
        draft_vocab_size=draft_vocab,
    )


def randomize(model: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def write_pair(folder: Path, seed: int = 0, window: int = WINDOW) -> tuple[Path, Path]:
    target = LlamaForCausalLM(target_config())
    randomize(target, seed)
    drafter = Eagle3Drafter(drafter_config(window))
    randomize(drafter, seed + 1)
    save_model(target, folder / "target", dtype=torch.float32)
    save_model(drafter, folder / "drafter", dtype=torch.float32)
    write_byte_tokenizer(folder / "target")  # ids below VOCAB decode to bytes, as before
    return folder / "target", folder / "drafter"


def make_engine(pair: tuple[Path, Path], k: int = 2, **kwargs) -> Engine:
    """An engine over the random pair; k = 0 runs the target alone."""
    options = dict(
        tokens_per_page=4,
        num_pages=(256, 256),
        max_num_batched_tokens=64,
        max_prefill_chunk=16,
        max_num_seqs=16,
    )
    options.update(kwargs)
    drafter = str(pair[1]) if k > 0 else None
    return Engine(EngineConfig(model=str(pair[0]), drafter=drafter, num_spec_tokens=k, **options))


def random_prompts(count: int, seed: int, min_len: int = 1, max_len: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=g).tolist()
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]


def assert_pools_empty(engine: Engine) -> None:
    """No request holds pages (no page is used but by the prefix cache), and after a
    reset nothing is used."""
    assert not engine.requests
    for name, u in engine.manager.usage().items():
        assert u.used == u.cached, name
    engine.manager.reset_prefix_cache()
    for name, u in engine.manager.usage().items():
        assert u.used == 0, name
