"""Hugging Face folders a user brings, served by a whole cluster: a random checkpoint of each
family saved by ``transformers``, a BPE tokenizer trained on the fly, and a drafter in the
published EAGLE-3 layout. Through the router (disaggregated, unified layout) the greedy text
equals ``transformers``' greedy ``generate`` decoded by its own tokenizer, streamed, over gRPC
and the OpenAI API (chat rendered with the model's template)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from deploy.local import LocalCluster
from proto.tandem.v1 import client_pb2 as cpb
from tests.e2e.conftest import assert_no_request_holds_pages, stream
from tests.services.engine.models.hf_models import hf_checkpoint
from tests.services.engine.tokenizer_helpers import trained_bpe, write_folder

pytestmark = pytest.mark.slow
MAX_TOKENS = 16
PROMPT = "naïve café, the quick brown fox jumps over the lazy dog 😀 and more"
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FAMILIES = {  # family -> (config overrides, chat template)
    "llama": ({}, LLAMA3_TEMPLATE),
    "qwen2": ({}, QWEN_TEMPLATE),
    "qwen3": ({"head_dim": 24}, QWEN_TEMPLATE),
    "mistral": ({"sliding_window": 8}, None),  # a window shorter than the prompt
}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "héllo wörld, what is a fox?"},
]


def published_drafter(
    folder: Path, config: transformers.PretrainedConfig, draft_vocab: int, seed: int
) -> None:
    """A random EAGLE-3 drafter as SpecForge saves one: no eagle_config, ``midlayer.*``, a
    reduced draft vocabulary with d2t/t2d, no embed_tokens."""
    tensors = drafter_tensors(config, draft_vocab, torch.Generator().manual_seed(seed))
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(drafter_config(config, draft_vocab)))


def drafter_tensors(
    config: transformers.PretrainedConfig, draft_vocab: int, g: torch.Generator
) -> dict[str, torch.Tensor]:
    """The drafter's weights, drawn from ``g``: the covered draft vocabulary first, then each
    tensor in the order listed."""
    h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    hd, inter, vocab = h // heads, config.intermediate_size, config.vocab_size
    rand = lambda *shape: 0.2 * torch.randn(*shape, generator=g)  # noqa: E731
    norm = lambda: 1 + 0.1 * torch.randn(h, generator=g)  # noqa: E731
    covered = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[covered] = True
    attn = {"q_proj": heads * hd, "k_proj": kv * hd, "v_proj": kv * hd}
    return {
        "fc.weight": rand(h, 3 * h),
        "norm.weight": norm(),
        "lm_head.weight": rand(draft_vocab, h),
        "d2t": covered - torch.arange(draft_vocab),
        "t2d": t2d,
        "midlayer.self_attn.o_proj.weight": rand(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        **{
            f"midlayer.{n}.weight": norm()
            for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")
        },
        **{f"midlayer.self_attn.{n}.weight": rand(rows, 2 * h) for n, rows in attn.items()},
    }


def drafter_config(config: transformers.PretrainedConfig, draft_vocab: int) -> dict:
    """config.json of a one-layer EAGLE-3 drafter over ``config``'s target."""
    h, heads = config.hidden_size, config.num_attention_heads
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "draft_vocab_size": draft_vocab,
        "hidden_size": h,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": config.num_key_value_heads,
        "num_hidden_layers": 1,
        "head_dim": h // heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    """(family, transformers model, its tokenizer, chat template, running cluster)."""
    family = request.param
    overrides, template = FAMILIES[family]
    root = tmp_path_factory.mktemp(family)
    tok = trained_bpe(400)
    eos = tok.token_to_id("</s>")
    model = hf_checkpoint(
        root / "target",
        family,
        seed=7,
        vocab_size=tok.get_vocab_size(),
        num_hidden_layers=5,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=eos,
        **overrides,
    )
    write_folder(root / "target", tok, template)
    published_drafter(root / "drafter", model.config, draft_vocab=96, seed=8)
    hf_tok = transformers.AutoTokenizer.from_pretrained(root / "target")
    cluster = pair_cluster(root, drafter=True)
    yield family, model, hf_tok, template, cluster
    cluster.stop()


def worker_args(root: Path) -> list[str]:
    """Each worker of the cluster: the pair in ``root``, K = 3, unified, 4-token pages."""
    return [
        "--model",
        str(root / "target"),
        "--drafter",
        str(root / "drafter"),
        "-k",
        "3",
        "--layout",
        "unified",
        "--tokens-per-page",
        "4",
        "--kv-cache-mb",
        "8",
        "--max-num-seqs",
        "8",
    ]


def pair_cluster(
    root: Path, drafter: bool, roles=("prefill", "decode"), router_extra: tuple[str, ...] = ()
) -> LocalCluster:
    """A started cluster serving the pair in ``root`` (:func:`worker_args`), or its target
    alone (``--drafter none``, the layout left to the workers) when ``drafter`` is false;
    ``router_extra``: more router flags."""
    worker = worker_args(root)
    if not drafter:
        args = dict(zip(worker[::2], worker[1::2], strict=True))
        args.update({"--drafter": "none", "--layout": "auto"})
        worker = [x for kv in args.items() for x in kv]
    router = ["--model", str(root / "target"), "-k", "3", "--tokens-per-page", "4", *router_extra]
    cluster = LocalCluster(worker, router, list(roles), start_timeout_s=120)
    cluster.start()
    return cluster


def reference(model, hf_tok, ids: list[int]) -> tuple[list[int], str]:
    """transformers' greedy continuation of ``ids``: (new ids, their decoded text)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=hf_tok.pad_token_id
        )
    new = out[0, len(ids) :].tolist()
    return new, hf_tok.decode(new, skip_special_tokens=True)


def test_grpc_stream_equals_transformers_greedy_text(served):
    family, model, hf_tok, _, cluster = served
    ids, text = reference(model, hf_tok, hf_tok(PROMPT)["input_ids"])
    request = cpb.GenerateRequest(text=PROMPT, sampling=cpb.SamplingParams(max_tokens=MAX_TOKENS))
    tokens, streamed, complete = stream(cluster.router_address, request)
    assert tokens == ids, family
    assert streamed == text
    assert complete.usage.prompt_tokens == len(hf_tok(PROMPT)["input_ids"])
    assert {t.group for t in complete.usage.transfers} == {"target", "draft"}
    assert_no_request_holds_pages(cluster)


def test_openai_chat_uses_the_models_template(served):
    family, model, hf_tok, template, cluster = served
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=cluster.http_address + "/v1", api_key="none", max_retries=0)
    name = client.models.list().data[0].id
    if template is None:  # no template: chat is refused by name, completions still work
        with pytest.raises(BadRequestError, match="chat template"):
            client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=4)
        done = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert done.choices[0].text == reference(model, hf_tok, hf_tok(PROMPT)["input_ids"])[1]
        return
    ids = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    _, text = reference(model, hf_tok, list(ids))
    stream = client.chat.completions.create(
        model=name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text, family
    assert_no_request_holds_pages(cluster)
