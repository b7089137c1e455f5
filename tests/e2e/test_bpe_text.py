"""Text through the whole cluster with a BPE vocabulary trained on the fly (multi-byte
tokens, byte pieces, specials): the streamed text is ``decode(ids)`` of the streamed ids,
and a stop string spanning two tokens ends the request where the text is cut."""

from __future__ import annotations

import grpc
import pytest
import torch

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from services.engine.models import Eagle3Drafter, LlamaForCausalLM, save_model
from services.tokenization.tokenizer import load_tokenizer
from tests.e2e.conftest import start_cluster
from tests.services.engine.helpers import drafter_config, randomize, target_config
from tests.services.engine.tokenizer_helpers import trained_bpe, write_folder

pytestmark = pytest.mark.slow
PROMPT = "héllo wörld, the quick brown fox 😀"


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe-pair")
    vocab = trained_bpe().get_vocab_size()
    target = LlamaForCausalLM(target_config(vocab))
    randomize(target, 3)
    drafter = Eagle3Drafter(drafter_config(vocab=vocab))
    randomize(drafter, 4)
    save_model(target, folder / "target", dtype=torch.float32)
    save_model(drafter, folder / "drafter", dtype=torch.float32)
    write_folder(folder / "target", trained_bpe())
    return folder / "target", folder / "drafter"


@pytest.fixture(scope="module")
def cluster(bpe_pair):
    cluster = start_cluster(bpe_pair, ["prefill", "decode"])
    yield cluster
    cluster.stop()


def _stream(address: str, max_tokens: int, stop: tuple[str, ...] = ()):
    """(token ids, chunk texts, finish reason) of a greedy text request."""
    request = cpb.GenerateRequest(
        text=PROMPT,
        sampling=cpb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, stop=stop),
    )
    ids, texts, reason = [], [], None
    with grpc.insecure_channel(address) as channel:
        for m in cpb_grpc.TandemStub(channel).Generate(request, timeout=60):
            if m.WhichOneof("payload") == "chunk":
                ids += m.chunk.token_ids
                texts.append(m.chunk.text)
            elif m.WhichOneof("payload") == "complete":
                reason = m.complete.finish_reason
    return ids, texts, reason


def test_streamed_text_is_the_decoded_ids_and_no_chunk_splits_a_character(cluster, bpe_pair):
    tok = load_tokenizer(str(bpe_pair[0]))
    ids, texts, reason = _stream(cluster.router_address, 40)
    assert reason == cpb.FINISH_REASON_LENGTH and len(ids) == 40
    assert "".join(texts) == tok.decode(ids)
    assert not any(t.endswith("\ufffd") for t in texts[:-1])


def test_a_stop_string_spanning_two_tokens_stops_the_request(cluster, bpe_pair):
    tok = load_tokenizer(str(bpe_pair[0]))
    ids, _, _ = _stream(cluster.router_address, 40)
    spans = [
        i
        for i in range(2, len(ids))
        if len(tok.decode(ids[i - 1 : i])) >= 2 and len(tok.decode(ids[i : i + 1])) >= 2
    ]
    assert spans, [tok.decode([t]) for t in ids]
    i = spans[0]
    before = tok.decode(ids[:i])
    stop = before[-2:] + tok.decode(ids[: i + 1])[len(before) :][:2]
    full = tok.decode(ids)
    cut = full.index(stop)
    stopped, texts, reason = _stream(cluster.router_address, 40, stop=(stop,))
    assert reason == cpb.FINISH_REASON_STOP
    assert "".join(texts) == full[:cut]
    assert len(tok.decode(stopped)) >= cut + len(stop) > len(tok.decode(stopped[:-1]))
