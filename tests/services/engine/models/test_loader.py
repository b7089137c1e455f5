"""Checkpoint layouts: shards listed by an index, a tied config that also stores the
head, mismatches named; tensor-parallel slices of the family tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine.models import LlamaForCausalLM, load_target
from services.engine.parallel import TensorParallel, shard_state_dict
from tests.services.engine.models.hf_models import hf_checkpoint, hf_logits, prompt, tandem_logits

INDEX = "model.safetensors.index.json"


def test_sharded_checkpoint_loads_through_its_index(tmp_path):
    reference = hf_checkpoint(tmp_path, "qwen2", max_shard_size="100KB")
    weight_map = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    ids = prompt(24)
    assert (tandem_logits(load_target(tmp_path), ids) - hf_logits(reference, ids)).abs().max() < 1e-4


def test_index_decides_the_files(tmp_path):
    """A stray safetensors file the index does not list is not read."""
    hf_checkpoint(tmp_path, "llama", max_shard_size="100KB")
    save_file({"stray.weight": torch.zeros(2)}, str(tmp_path / "stray.safetensors"))
    load_target(tmp_path)


def test_missing_shard_is_named(tmp_path):
    hf_checkpoint(tmp_path, "llama", max_shard_size="100KB")
    shard = sorted(set(json.loads((tmp_path / INDEX).read_text())["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    with pytest.raises(ValueError, match=f"model_path: .*lacks \\['{shard}'\\], listed in {INDEX}"):
        load_target(tmp_path)


def test_tied_config_with_a_stored_head_loads_and_uses_the_embedding(tmp_path):
    reference = hf_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, str(path), metadata={"format": "pt"})
    model = load_target(tmp_path)
    assert model.lm_head is None
    ids = prompt(24)
    assert (tandem_logits(model, ids) - hf_logits(reference, ids)).abs().max() < 1e-4


def test_untied_config_without_its_head_is_refused(tmp_path):
    hf_checkpoint(tmp_path, "llama")
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    del state["lm_head.weight"]
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        load_target(tmp_path)


def test_tensor_of_the_wrong_shape_is_named(tmp_path):
    hf_checkpoint(tmp_path, "qwen3")
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    state["model.layers.1.self_attn.k_norm.weight"] = torch.ones(3)
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight has shape"):
        load_target(tmp_path)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_tp_shards_biases_with_their_rows_and_replicates_qk_norms(tmp_path, family):
    hf_checkpoint(tmp_path, family)
    config = load_target(tmp_path).config
    state = load_file(str(tmp_path / "model.safetensors"))
    shards = []
    for rank in range(2):
        model = LlamaForCausalLM(config, TensorParallel(2, rank))
        shard = shard_state_dict(model, state)
        model.load_state_dict(shard)  # strict: every tensor has this rank's shape
        shards.append(shard)
    attn = "model.layers.0.self_attn."
    names = (
        ["q_proj.bias", "k_proj.bias", "v_proj.bias"]
        if family == "qwen2"
        else ["q_norm.weight", "k_norm.weight"]
    )
    for name in names:
        parts = [s[attn + name] for s in shards]
        whole = torch.cat(parts) if name.endswith("bias") else parts[0]
        assert torch.equal(whole, state[attn + name]), name
        assert name.endswith("bias") or torch.equal(parts[1], state[attn + name])
