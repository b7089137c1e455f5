"""Model definitions and HF-folder loading: exact round trips, paged == dense."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvcore.ops import PagedBatch
from services.engine.models import (
    DenseContext,
    Eagle3Drafter,
    EagleConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PagedContext,
    load_drafter,
    load_target,
    save_model,
)
from services.engine.models.layers import Rotary, rope_inv_freq
from tests.services.engine.helpers import drafter_config, randomize, target_config

PAGE = 4


def paged_context(
    model_layers: int,
    kv_heads: int,
    head_dim: int,
    spans: list[tuple[int, int]],
    pool: torch.Tensor | None = None,
    window: int = 0,
) -> PagedContext:
    """One sequence held in pages 0, 1, 2...; spans [(start, length)] of one batch row each."""
    if pool is None:
        pool = torch.zeros(16, model_layers, 2, kv_heads, PAGE, head_dim)
    table = torch.arange(16, dtype=torch.int32).repeat(len(spans), 1)
    lengths = [n for _, n in spans]
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([s + n for s, n in spans], dtype=torch.int32)
    slots = torch.cat([torch.arange(s, s + n) for s, n in spans])
    batch = PagedBatch(table, seq_lens, max(lengths, default=0), qsl, window)
    return PagedContext(pool, batch, slots)


def test_target_round_trips_through_safetensors(tmp_path):
    model = LlamaForCausalLM(target_config())
    randomize(model, 3)
    save_model(model, tmp_path, dtype=torch.float32)
    loaded = load_target(tmp_path)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert "lm_head.weight" in load_file(str(tmp_path / "model.safetensors"))


def test_tied_target_has_no_lm_head_tensor(tmp_path):
    config = LlamaConfig.from_dict({**target_config().to_dict(), "tie_word_embeddings": True})
    save_model(LlamaForCausalLM(config), tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    assert load_target(tmp_path).lm_head is None


def test_drafter_uses_eagle3_tensor_names(tmp_path):
    save_model(Eagle3Drafter(drafter_config()), tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {
        "fc.weight",
        "norm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.mlp.down_proj.weight",
    } <= names
    assert load_drafter(tmp_path).config.aux_layer_ids == (0, 1, 2)


def test_missing_tensor_is_named(tmp_path):
    save_model(LlamaForCausalLM(target_config()), tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(path))
    with pytest.raises(ValueError, match=r"model_path: .*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_target(tmp_path)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="model_path"):
        load_target(tmp_path)


def test_paged_target_in_chunks_equals_dense():
    torch.manual_seed(0)
    model = LlamaForCausalLM(target_config())
    randomize(model, 5)
    c = model.config
    ids = torch.randint(0, c.vocab_size, (23,))
    dense = model(ids, torch.arange(23), DenseContext(1, 23)).hidden
    pool = torch.zeros(16, c.num_hidden_layers, 2, c.num_key_value_heads, PAGE, c.head_dim)
    chunks = []
    for start, end in ((0, 9), (9, 10), (10, 23)):
        ctx = paged_context(
            c.num_hidden_layers, c.num_key_value_heads, c.head_dim, [(start, end - start)], pool
        )
        chunks.append(model(ids[start:end], torch.arange(start, end), ctx).hidden)
    torch.testing.assert_close(torch.cat(chunks), dense, atol=1e-4, rtol=1e-4)


def test_paged_windowed_drafter_equals_dense():
    torch.manual_seed(0)
    target = LlamaForCausalLM(target_config())
    drafter = Eagle3Drafter(drafter_config(window=5))
    randomize(drafter, 6)
    ids, hidden = torch.randint(0, 32, (19,)), torch.randn(19, 64)
    dense = drafter(ids, hidden, torch.arange(19), DenseContext(1, 19, window=5), target)
    c = drafter.config
    ctx = paged_context(1, c.num_key_value_heads, c.head_dim, [(0, 19)], window=5)
    paged = drafter(ids, hidden, torch.arange(19), ctx, target)
    torch.testing.assert_close(paged, dense, atol=1e-4, rtol=1e-4)


def test_reduced_draft_vocabulary_maps_through_d2t():
    target = LlamaForCausalLM(target_config())
    drafter = Eagle3Drafter(drafter_config(draft_vocab=4))
    drafter.d2t.copy_(torch.tensor([0, 4, 8, 27]))  # draft ids 0..3 -> target 0, 5, 10, 30
    logits = drafter.compute_logits(torch.randn(2, 64), target)
    finite = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert finite == [0, 5, 10, 30]
    assert logits.shape == (2, 32)


def test_rope_scaling_variants():
    base = rope_inv_freq(16, 10000.0, None)
    torch.testing.assert_close(rope_inv_freq(16, 10000.0, {"type": "linear", "factor": 4.0}), base / 4)
    llama3 = rope_inv_freq(
        16,
        10000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    )
    assert llama3[0] == base[0]  # short wavelengths are kept
    assert llama3[-1] == base[-1] / 8  # long wavelengths are divided by the factor
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaConfig.from_dict({**target_config().to_dict(), "rope_scaling": {"type": "yarn"}})


@pytest.mark.parametrize(
    "field,value", [("hidden_size", 0), ("num_key_value_heads", 3), ("num_hidden_layers", -1)]
)
def test_bad_target_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LlamaConfig.from_dict({**target_config().to_dict(), field: value})


def test_drafter_must_fit_the_target():
    config = EagleConfig.from_dict(
        {**drafter_config().to_dict(), "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}}
    )
    with pytest.raises(ValueError, match="aux_layer_ids"):
        config.check_target(target_config())


def test_merged_projections_write_the_same_pages_as_separate_ones():
    """A merged q/k/v goes through the paged context's ``attend_packed`` (RoPE applied as
    the KV is written, kvcore's ``write_rotated_kv``); separate ones rotate, then write.
    Same hidden states, same pages."""
    model = LlamaForCausalLM(target_config()).eval()
    randomize(model, 5)
    c = model.config
    ids, positions = torch.randint(0, c.vocab_size, (10,)), torch.arange(10)
    contexts = [
        paged_context(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, [(0, 10)]) for _ in "ab"
    ]
    with torch.inference_mode():
        separate = model(ids, positions, contexts[0]).hidden
        model.merge_projections()
        merged = model(ids, positions, contexts[1]).hidden
    torch.testing.assert_close(merged, separate, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(contexts[1].kv_pool, contexts[0].kv_pool, rtol=1e-5, atol=1e-5)
    assert contexts[1].kv_pool[:3].abs().sum() > 0


def test_rope_tables_stay_float32_in_a_bf16_model():
    """cos/sin are float32 whatever the model's dtype (its frequency buffer is cast with it),
    halves repeating: what kvcore's write_rotated_kv and the rotate kernels take."""
    rotary = Rotary(16, 10000.0, None).to(torch.bfloat16)
    positions = torch.tensor([0, 5, 4095])
    cos, sin = rotary(positions)
    angles = positions.float()[:, None] * rotary.inv_freq[:8].float()[None, :]
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (3, 1, 16)
    assert torch.equal(cos[:, 0, :8], angles.cos()) and torch.equal(cos[:, 0, 8:], angles.cos())
    assert torch.equal(sin[:, 0, 8:], angles.sin())
