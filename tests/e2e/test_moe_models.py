"""A user's mixture-of-experts folder (Qwen3-MoE, Mixtral, gpt-oss with a 16-token window
on alternate layers and attention sinks: a random checkpoint saved by
``transformers`` in the published per-expert layout, a BPE tokenizer trained on the fly),
served by a disaggregated cluster with a drafter in the published EAGLE-3 layout (unified
KV) and without one: the streamed greedy text equals ``transformers``' greedy ``generate``,
every target layer group's (and the drafter's) pages move from the prefill to the decode worker, and no
request holds pages afterwards."""

from __future__ import annotations

import pytest
import torch
import transformers

from proto.tandem.v1 import client_pb2 as cpb
from tests.e2e.conftest import assert_no_request_holds_pages, stream
from tests.e2e.test_hf_models import PROMPT, pair_cluster, published_drafter
from tests.services.engine.models.hf_models import MOE, hf_checkpoint
from tests.services.engine.tokenizer_helpers import trained_bpe, write_folder

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
LONG_PROMPT = " ".join([PROMPT] * 2)


def moe_folders(root, family: str, seed: int, **overrides):
    """``root``/target (a random ``family`` checkpoint saved by transformers, a trained BPE
    tokenizer) and ``root``/drafter (published EAGLE-3 layout); returns (the transformers
    model, its tokenizer)."""
    tok = trained_bpe(400)
    model = hf_checkpoint(
        root / "target",
        family,
        seed=seed,
        **{**MOE[family], **overrides},
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
    )
    write_folder(root / "target", tok)
    published_drafter(root / "drafter", model.config, draft_vocab=96, seed=seed + 1)
    return model, transformers.AutoTokenizer.from_pretrained(root / "target")


def greedy_reference(model, hf_tok, text: str) -> list[int]:
    """transformers' greedy continuation of ``text``: MAX_TOKENS new ids."""
    ids = hf_tok(text)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=hf_tok.pad_token_id
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "gpt_oss"])
def folders(request, tmp_path_factory):
    """(family, root holding target/ and drafter/, the transformers model, its tokenizer)."""
    root = tmp_path_factory.mktemp(request.param)
    model, hf_tok = moe_folders(root, request.param, seed=11, num_hidden_layers=4)
    return request.param, root, model, hf_tok


@pytest.fixture(scope="module", params=["drafter", "none"])
def served(request, folders):
    """(whether a drafter runs, a running prefill + decode cluster)."""
    cluster = pair_cluster(folders[1], drafter=request.param == "drafter")
    yield request.param == "drafter", cluster
    cluster.stop()


def test_greedy_text_equals_transformers(folders, served):
    family, _, model, hf_tok = folders
    drafting, cluster = served
    assert len(hf_tok(LONG_PROMPT)["input_ids"]) > 16  # past gpt-oss's window
    want = greedy_reference(model, hf_tok, LONG_PROMPT)
    request = cpb.GenerateRequest(text=LONG_PROMPT, sampling=cpb.SamplingParams(max_tokens=MAX_TOKENS))
    tokens, text, complete = stream(cluster.router_address, request)
    assert tokens == want
    assert text == hf_tok.decode(want, skip_special_tokens=True)
    target = {"target", "target_sliding"} if family == "gpt_oss" else {"target"}
    assert {t.group for t in complete.usage.transfers} == target | ({"draft"} if drafting else set())
    assert_no_request_holds_pages(cluster)


TP_LAYOUTS = {  # name -> the cluster's roles: aggregated TP 2, and a TP 2 prefill beside a TP 1 decode
    "aggregated-tp2": [("both", ["--tp", "2"])],
    "prefill-tp2-decode-tp1": [("prefill", ["--tp", "2"]), ("decode", ["--tp", "1"])],
}


@pytest.mark.parametrize("layout", TP_LAYOUTS)
def test_gpt_oss_under_tensor_parallelism_equals_transformers(tmp_path_factory, layout):
    """Experts split over their intermediate size, sinks over the heads, the drafter's KV moved
    beside both target groups when the pair differs in TP."""
    root = tmp_path_factory.mktemp("gpt-oss-tp")
    model, hf_tok = moe_folders(root, "gpt_oss", seed=13)
    want = greedy_reference(model, hf_tok, LONG_PROMPT)
    cluster = pair_cluster(root, drafter=True, roles=TP_LAYOUTS[layout])
    try:
        request = cpb.GenerateRequest(text=LONG_PROMPT, sampling=cpb.SamplingParams(max_tokens=MAX_TOKENS))
        tokens, _, _ = stream(cluster.router_address, request)
        assert tokens == want
        assert_no_request_holds_pages(cluster)
    finally:
        cluster.stop()
