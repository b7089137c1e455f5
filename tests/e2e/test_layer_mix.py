"""A user's Qwen2 folder whose layers alternate a 64-token window and full attention (a
random checkpoint saved by ``transformers``, a BPE tokenizer trained on the fly), served by
a disaggregated cluster with and without a drafter in the published EAGLE-3 layout: for a
prompt longer than the window, the streamed greedy text equals ``transformers``' greedy
``generate``, the pages of both target layer groups (and the drafter's) move from the
prefill to the decode worker, and no request holds pages afterwards."""

from __future__ import annotations

import pytest
import torch
import transformers

from proto.tandem.v1 import client_pb2 as cpb
from tests.e2e.conftest import assert_no_request_holds_pages, stream
from tests.e2e.test_hf_models import PROMPT, pair_cluster, published_drafter
from tests.services.engine.models.hf_models import hf_checkpoint, layer_mix
from tests.services.engine.tokenizer_helpers import trained_bpe, write_folder

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
WINDOW = 64
LONG_PROMPT = " ".join([PROMPT] * 4)  # past the window
MIX = layer_mix(WINDOW)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(root holding target/ and drafter/, the transformers model, its tokenizer)."""
    root = tmp_path_factory.mktemp("layer-mix")
    tok = trained_bpe(400)
    model = hf_checkpoint(
        root / "target",
        "qwen2",
        seed=7,
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        **MIX,
    )
    write_folder(root / "target", tok)
    published_drafter(root / "drafter", model.config, draft_vocab=96, seed=8)
    return root, model, transformers.AutoTokenizer.from_pretrained(root / "target")


@pytest.fixture(scope="module", params=["drafter", "none"])
def served(request, folders):
    """(whether a drafter runs, a running prefill + decode cluster)."""
    cluster = pair_cluster(folders[0], drafter=request.param == "drafter")
    yield request.param == "drafter", cluster
    cluster.stop()


def test_greedy_text_equals_transformers_and_every_group_is_transferred(folders, served):
    _, model, hf_tok = folders
    drafting, cluster = served
    ids = hf_tok(LONG_PROMPT)["input_ids"]
    assert len(ids) > WINDOW
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        pad_token_id=hf_tok.pad_token_id,
    )
    want = out[0, len(ids) :].tolist()
    request = cpb.GenerateRequest(text=LONG_PROMPT, sampling=cpb.SamplingParams(max_tokens=MAX_TOKENS))
    tokens, text, complete = stream(cluster.router_address, request)
    assert tokens == want
    assert text == hf_tok.decode(want, skip_special_tokens=True)
    groups = {"target", "target_sliding"} | ({"draft"} if drafting else set())
    assert {t.group for t in complete.usage.transfers} == groups
    assert_no_request_holds_pages(cluster)
