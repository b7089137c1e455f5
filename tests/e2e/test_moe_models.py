"""A user's mixture-of-experts folder (Qwen3-MoE, Mixtral, gpt-oss with a 16-token window
on alternate layers and attention sinks: a random checkpoint saved by
``transformers`` in the published per-expert layout, a BPE tokenizer trained on the fly),
served by a disaggregated cluster with a drafter in the published EAGLE-3 layout (unified
KV) and, for Qwen3-MoE, without one, and gpt-oss under TP 2 (aggregated, and a TP 2 prefill
beside a TP 1 decode): the streamed greedy text equals ``transformers``' greedy ``generate``,
every target layer group's (and the drafter's) pages move from the prefill to the decode worker, and no
request holds pages afterwards."""

from __future__ import annotations

import pytest
import torch
import transformers

from proto.tandem.v1 import client_pb2 as cpb
from tests.e2e.conftest import assert_no_request_holds_pages, generate, stream
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


CASES = {  # id -> (family, whether a drafter runs): every family with its drafter, and
    # without one (layout auto, no draft group) qwen3_moe only: the MoE layers run the same
    # with or without a drafter, so mixtral's and gpt-oss's no-drafter runs exercised no path
    # this one and test_layer_mix's (two target groups, no drafter) don't
    "qwen3_moe-drafter": ("qwen3_moe", True),
    "qwen3_moe-none": ("qwen3_moe", False),
    "mixtral-drafter": ("mixtral", True),
    "gpt_oss-drafter": ("gpt_oss", True),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> (root holding target/ and drafter/, the transformers model, its tokenizer,
    its greedy continuation of LONG_PROMPT), each family's built once for the module."""
    built = {}

    def get(family: str):
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            model, hf_tok = moe_folders(root, family, seed=11, num_hidden_layers=4)
            built[family] = root, model, hf_tok, greedy_reference(model, hf_tok, LONG_PROMPT)
        return built[family]

    return get


@pytest.fixture(scope="module", params=list(CASES.values()), ids=list(CASES))
def served(request, folders):
    """(family, whether a drafter runs, a running prefill + decode cluster)."""
    family, drafting = request.param
    cluster = pair_cluster(folders(family)[0], drafter=drafting)
    yield family, drafting, cluster
    cluster.stop()


def test_greedy_text_equals_transformers(folders, served):
    family, drafting, cluster = served
    _, _, hf_tok, want = folders(family)
    assert len(hf_tok(LONG_PROMPT)["input_ids"]) > 16  # past gpt-oss's window
    request = cpb.GenerateRequest(text=LONG_PROMPT, sampling=cpb.SamplingParams(max_tokens=MAX_TOKENS))
    tokens, text, complete = stream(cluster.router_address, request)
    assert tokens == want
    assert text == hf_tok.decode(want, skip_special_tokens=True)
    target = {"target", "target_sliding"} if family == "gpt_oss" else {"target"}
    assert {t.group for t in complete.usage.transfers} == target | ({"draft"} if drafting else set())
    assert_no_request_holds_pages(cluster)


# One cluster for both TP layouts: an aggregated TP 2 worker (called directly: the router
# sends to the pair while it is ready) and a TP 2 prefill beside a TP 1 decode (the router's pair)
TP_ROLES = [("both", ["--tp", "2"]), ("prefill", ["--tp", "2"]), ("decode", ["--tp", "1"])]
TP_LAYOUTS = ["aggregated-tp2", "prefill-tp2-decode-tp1"]


@pytest.fixture(scope="module")
def tp_cluster(folders):
    cluster = pair_cluster(folders("gpt_oss")[0], drafter=True, roles=TP_ROLES)
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("layout", TP_LAYOUTS)
def test_gpt_oss_under_tensor_parallelism_equals_transformers(folders, tp_cluster, layout):
    """Experts split over their intermediate size, sinks over the heads, the drafter's KV moved
    beside both target groups when the pair differs in TP."""
    _, _, hf_tok, want = folders("gpt_oss")
    if layout == "aggregated-tp2":
        address = next(p.grpc for p in tp_cluster.processes if p.name == "both-0")
        tokens, _ = generate(address, hf_tok(LONG_PROMPT)["input_ids"], MAX_TOKENS)
    else:
        request = cpb.GenerateRequest(text=LONG_PROMPT, sampling=cpb.SamplingParams(max_tokens=MAX_TOKENS))
        tokens, _, complete = stream(tp_cluster.router_address, request)
        assert {t.group for t in complete.usage.transfers} == {"target", "target_sliding", "draft"}
    assert tokens == want
    assert_no_request_holds_pages(tp_cluster)
