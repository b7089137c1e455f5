"""An FP8 folder a user brings (compressed-tensors FP8-Dynamic: e4m3 weights with a scale per
channel, activations per token), with a published-layout EAGLE-3 drafter quantized the same
way, served aggregated and disaggregated: the speculative greedy output equals the FP8
target's own greedy output (target-only, computed in-process), token for token."""

from __future__ import annotations

import pytest
import torch
import transformers

from proto.tandem.v1 import client_pb2 as cpb
from services.engine.models import load_target
from tests.e2e.conftest import assert_no_request_holds_pages, generate, stream
from tests.e2e.test_hf_models import PROMPT, pair_cluster, published_drafter
from tests.services.engine.models.fp8_folders import write_fp8
from tests.services.engine.models.hf_models import hf_checkpoint, tandem_logits
from tests.services.engine.tokenizer_helpers import trained_bpe, write_folder

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


def drafter_linears(state: dict) -> list[str]:
    """The drafter's own linears: fc and its layer's projections (its head stays as it is)."""
    return [n for n in state if n == "fc.weight" or (n.startswith("midlayer.") and n.endswith("proj.weight"))]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """root/target and root/drafter: both FP8-Dynamic, as published."""
    root = tmp_path_factory.mktemp("fp8")
    tok = trained_bpe(400)
    model = hf_checkpoint(
        root / "float",
        "llama",
        seed=21,
        num_hidden_layers=4,
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
    )
    write_folder(root / "float", tok)
    write_fp8(root / "float", root / "target", "dynamic")
    published_drafter(root / "float-drafter", model.config, draft_vocab=96, seed=22)
    write_fp8(root / "float-drafter", root / "drafter", "dynamic", names=drafter_linears)
    return root


@pytest.fixture(scope="module")
def reference(root) -> tuple[list[int], list[int]]:
    """(the prompt's ids, the FP8 target's own greedy continuation: dense forward, in-process)."""
    ids = transformers.AutoTokenizer.from_pretrained(root / "target")(PROMPT)["input_ids"]
    model, out = load_target(root / "target"), list(ids)
    for _ in range(MAX_TOKENS):
        out.append(int(tandem_logits(model, torch.tensor(out))[-1].argmax()))
    return ids, out[len(ids) :]


@pytest.fixture(scope="module")
def cluster(root, reference):  # the reference first: idle processes take CPU
    """Both modes in one cluster: an aggregated worker (called directly: the router sends to
    the pair while it is ready) and a prefill + decode pair (the router's)."""
    cluster = pair_cluster(root, drafter=True, roles=("both", "prefill", "decode"))
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_speculative_greedy_equals_the_fp8_target(cluster, reference, mode):
    ids, want = reference
    if mode == "aggregated":
        tokens, _ = generate(next(p.grpc for p in cluster.processes if p.name == "both-0"), ids, MAX_TOKENS)
    else:
        request = cpb.GenerateRequest(text=PROMPT, sampling=cpb.SamplingParams(max_tokens=MAX_TOKENS))
        tokens, _, complete = stream(cluster.router_address, request)
        assert {t.group for t in complete.usage.transfers} == {"target", "draft"}
    assert tokens == want
    assert_no_request_holds_pages(cluster)
