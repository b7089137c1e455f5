"""Stop strings on a BPE vocabulary: matched on text that spans tokens, cut at the same place
by the engine (output text) and the router (StopTrimmer over incrementally decoded chunks)."""

from __future__ import annotations

import pytest

from services.engine.request import Request
from services.engine.sampling.params import SamplingParams
from services.engine.stopping import append_tokens, output_text
from services.router.stop_trimmer import StopTrimmer
from services.tokenization.detokenizer import Detokenizer
from services.tokenization.tokenizer import load_tokenizer
from tests.services.engine.tokenizer_helpers import trained_bpe, trained_metaspace, write_folder

TEXT = "héllo wörld, the quick brown fox 😀 jumps over the lazy dog"


@pytest.fixture(scope="module", params=["bpe", "metaspace"])
def tok(request, tmp_path_factory):
    build = trained_bpe if request.param == "bpe" else trained_metaspace
    return load_tokenizer(str(write_folder(tmp_path_factory.mktemp(request.param), build())))


def _spanning_stop(tok, ids: list[int]) -> tuple[str, int]:
    """A stop string made of the end of ids[i - 1]'s text and the start of ids[i]'s, and i."""
    for i in range(2, len(ids) - 1):
        before, after = tok.decode(ids[:i]), tok.decode(ids[: i + 1])
        if len(before) - len(tok.decode(ids[: i - 1])) >= 2 and len(after) - len(before) >= 2:
            return after[len(before) - 2 : len(before) + 2], i
    raise AssertionError("no two multi-character tokens in a row")


def _run(tok, ids: list[int], sampling: SamplingParams) -> tuple[Request, Detokenizer, list[int]]:
    req = Request("r", [1], sampling, None)
    detok = Detokenizer(tok)
    for t in ids:  # one token per step, as a decode worker without drafts emits them
        append_tokens(req, [t], detok, frozenset())
        if req.finish_reason is not None:
            break
    return req, detok, list(req.output_ids)


def test_a_stop_string_spanning_two_tokens_stops_the_request_at_the_second(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    stop, i = _spanning_stop(tok, ids)
    req, detok, emitted = _run(tok, ids, SamplingParams(max_tokens=100, stop=(stop,)))
    assert req.finish_reason == "stop" and emitted == ids[: i + 1]
    full = tok.decode(ids)
    assert output_text(req, detok, finished=True) == full[: full.index(stop)]


def test_the_router_cuts_the_streamed_text_where_the_engine_does(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    stop, _ = _spanning_stop(tok, ids)
    req, detok, emitted = _run(tok, ids, SamplingParams(max_tokens=100, stop=(stop,)))
    engine_text = output_text(req, detok, finished=True)
    router, trimmer = Detokenizer(tok), StopTrimmer([stop])
    streamed = [trimmer.feed(router.push([t])) for t in emitted]
    streamed.append(trimmer.feed(router.flush()) + trimmer.flush())
    assert "".join(streamed) == engine_text


def test_without_a_stop_the_streamed_text_is_the_decoded_output(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    req, detok, emitted = _run(tok, ids, SamplingParams(max_tokens=len(ids)))
    assert req.finish_reason == "length" and emitted == ids
    assert output_text(req, detok, finished=True) == tok.decode(ids)
