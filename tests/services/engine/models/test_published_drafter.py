"""An EAGLE-3 drafter in the published layout (the EAGLE authors' and SpecForge's): no
``eagle_config``, ``midlayer.*`` tensors, a reduced draft vocabulary with ``d2t``/``t2d``
buffers, no ``embed_tokens``. Built tensor by tensor with safetensors, checked against a
hand-written reference of the published formula, and served losslessly."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from models.byte_tokenizer import write_byte_tokenizer
from services.engine.models import (
    DenseContext,
    EagleConfig,
    LlamaConfig,
    LlamaForCausalLM,
    load_drafter,
    save_model,
)
from services.engine.models.config import read_config_json
from services.engine.sampling.params import SamplingParams
from tests.services.engine.helpers import make_engine, randomize

ROOT = Path(__file__).resolve().parents[4]
VOCAB, DRAFT_VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS = 64, 24, 64, 4, 2, 8
HEAD_DIM, INTER, THETA, EPS = HIDDEN // HEADS, 96, 500.0, 1e-5
DEFAULT_AUX = (1, 3, 4)  # outputs of layers (1, n // 2 - 1, n - 4), n = 8


def target_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
        rope_theta=THETA,
        eos_token_id=VOCAB - 1,
    )


def published_config(**extra) -> dict:
    """A SpecForge-style config.json (transformers-4 spelling, no eagle_config)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "rope_scaling": None,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "bos_token_id": 0,
        "eos_token_id": VOCAB - 1,
        "pad_token_id": 0,
        **extra,
    }


def draft_to_target(seed: int = 0) -> torch.Tensor:
    """[DRAFT_VOCAB] sorted target ids the draft vocabulary covers (the EOS among them)."""
    g = torch.Generator().manual_seed(seed)
    picked = torch.randperm(VOCAB - 1, generator=g)[: DRAFT_VOCAB - 1]
    return torch.cat([picked, torch.tensor([VOCAB - 1])]).sort().values


def published_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale: float = 0.2) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)

    def norm() -> torch.Tensor:
        return 1 + rand(HIDDEN, scale=0.1)

    targets = draft_to_target(seed)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[targets] = True
    return {
        "fc.weight": rand(HIDDEN, 3 * HIDDEN),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": rand(INTER, HIDDEN),
        "midlayer.mlp.up_proj.weight": rand(INTER, HIDDEN),
        "midlayer.mlp.down_proj.weight": rand(HIDDEN, INTER),
        "norm.weight": norm(),
        "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN, scale=1.0),
        "d2t": targets - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }


def write_published(folder: Path, seed: int = 0, **extra) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = published_tensors(seed)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(published_config(**extra), indent=2))
    return tensors


def write_target(folder: Path, seed: int = 3) -> LlamaForCausalLM:
    """A peaked random target whose head favours the draft vocabulary (as a real draft
    vocabulary holds the frequent tokens), so a random drafter's guesses are accepted
    now and then."""
    target = LlamaForCausalLM(target_config())
    randomize(target, seed)
    off_draft = torch.ones(VOCAB, dtype=torch.bool)
    off_draft[draft_to_target()] = False
    with torch.no_grad():
        target.lm_head.weight[off_draft] *= 0.2
    save_model(target, folder, dtype=torch.float32)
    write_byte_tokenizer(folder)
    return target.eval()


# ----------------------------------------------------------- the published formula


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim], rotate-half convention."""
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = (positions[:, None].double() * inv[None]).float()
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    half = HEAD_DIM // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def reference_logits(
    t: dict[str, torch.Tensor], embeds: torch.Tensor, hidden: torch.Tensor, norm_before_residual: bool
) -> torch.Tensor:
    """The EAGLE-3 mid layer as SpecForge/vLLM write it, one causal sequence of n rows:
    embeds, hidden [n, HIDDEN] -> [n, VOCAB] logits over target ids (-inf off-draft)."""
    n, m = embeds.shape[0], "midlayer."
    positions = torch.arange(n)
    normed = rms(hidden, t[m + "hidden_norm.weight"])
    x = torch.cat([rms(embeds, t[m + "input_layernorm.weight"]), normed], -1)
    residual = normed if norm_before_residual else hidden
    q = rope((x @ t[m + "self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), positions)
    k = rope((x @ t[m + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), positions)
    v = (x @ t[m + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = (z.repeat_interleave(HEADS // KV_HEADS, dim=1) for z in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    h = residual + attn @ t[m + "self_attn.o_proj.weight"].T
    y = rms(h, t[m + "post_attention_layernorm.weight"])
    y = F.silu(y @ t[m + "mlp.gate_proj.weight"].T) * (y @ t[m + "mlp.up_proj.weight"].T)
    g = h + y @ t[m + "mlp.down_proj.weight"].T
    draft = rms(g, t["norm.weight"]) @ t["lm_head.weight"].T  # [n, DRAFT_VOCAB]
    out = torch.full((n, VOCAB), float("-inf"))
    out[:, torch.arange(DRAFT_VOCAB) + t["d2t"]] = draft
    return out


# ----------------------------------------------------------------------- tests


def test_published_drafter_loads_with_default_aux_layers(tmp_path):
    write_published(tmp_path)
    drafter = load_drafter(tmp_path)
    assert drafter.config.aux_layer_ids == ()
    assert drafter.embed_tokens is None and drafter.config.draft_vocab_size == DRAFT_VOCAB
    assert drafter.config.check_target(target_config()).aux_layer_ids == DEFAULT_AUX
    assert torch.equal(drafter.t2d.nonzero().flatten(), draft_to_target())


@pytest.mark.parametrize(
    "ids,convention", [([1, 3, 4], None), ([2, 4, 5], None), ([1, 3, 4], "output"), ([2, 4, 5], "input")]
)
def test_both_numbering_conventions_name_the_same_layers(ids, convention):
    eagle = {"eagle_aux_hidden_state_layer_ids": ids}
    if convention:
        eagle["eagle_aux_hidden_state_layer_convention"] = convention
    config = EagleConfig.from_dict(published_config(eagle_config=eagle))
    assert config.check_target(target_config()).aux_layer_ids == DEFAULT_AUX


def test_tandem_marker_keeps_a_list_starting_at_zero():
    """Tandem's saver writes the convention, so its configs read back as written; the
    first-id rule alone would read [0, 2, 4] as inputs (layers -1, 1, 3)."""
    saved = replace(EagleConfig.from_dict(published_config()), aux_layer_ids=(0, 2, 4)).to_dict()
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_convention"] == "output"
    assert EagleConfig.from_dict(saved).aux_layer_ids == (0, 2, 4)
    del saved["eagle_config"]["eagle_aux_hidden_state_layer_convention"]
    assert EagleConfig.from_dict(saved).aux_layer_ids == (-1, 1, 3)


def test_bundled_drafter_keeps_its_layers():
    d = read_config_json(ROOT / "models/tiny-drafter")
    target = LlamaConfig.from_dict(read_config_json(ROOT / "models/tiny-target"))
    assert EagleConfig.from_dict(d).check_target(target).aux_layer_ids == (1, 3, 5)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_drafter_matches_the_published_formula(tmp_path, norm_before_residual):
    tensors = write_published(tmp_path, norm_before_residual=norm_before_residual)
    target = write_target(tmp_path / "target")
    drafter = load_drafter(tmp_path)
    assert drafter.config.norm_before_residual is norm_before_residual
    n = 12
    g = torch.Generator().manual_seed(5)
    ids, aux = torch.randint(0, VOCAB, (n,), generator=g), torch.randn(n, 3 * HIDDEN, generator=g)
    with torch.no_grad():
        hidden = drafter.project(aux)
        out = drafter(ids, hidden, torch.arange(n), DenseContext(1, n), target)
        got = drafter.compute_logits(out, target)
        want = reference_logits(
            tensors, target.embed(ids), aux @ tensors["fc.weight"].T, norm_before_residual
        )
        other = reference_logits(tensors, target.embed(ids), hidden, not norm_before_residual)
    on = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), on)
    assert (got[on] - want[on]).abs().max() < 1e-4
    assert (got[on] - other[on]).abs().max() > 1e-2  # the flag changes the output


def test_fc_norm_tensor_is_refused_by_name(tmp_path):
    tensors = write_published(tmp_path)
    tensors["fc_norm.weight"] = torch.ones(3 * HIDDEN)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc_norm.weight: .* is not supported"):
        load_drafter(tmp_path)


def test_speculative_greedy_equals_target_only(tmp_path):
    write_target(tmp_path / "target")
    write_published(tmp_path / "drafter", norm_before_residual=True)
    pair = (tmp_path / "target", tmp_path / "drafter")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 17, 30)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = make_engine(pair, k=3)
    assert spec.drafter.config.aux_layer_ids == DEFAULT_AUX
    want = [o.token_ids for o in make_engine(pair, k=0).generate(prompts, greedy)]
    outs = spec.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == want
    assert sum(o.usage.num_accepted for o in outs) > 0  # acceptance was exercised
