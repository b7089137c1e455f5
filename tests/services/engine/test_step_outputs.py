"""Delta outputs (a served worker's engine: each step's new tokens and logprobs, no text; the
router detokenizes): the same tokens, finish reasons and stops as cumulative outputs, stop
strings still matched on the text they need, and an engine's streamed deltas joined equal
its cumulative outputs, logprobs included."""

from __future__ import annotations

import pytest

from services.engine.request import Request, Status
from services.engine.sampling.params import SamplingParams
from services.engine.step_outputs import StepOutputs
from services.tokenization.tokenizer import load_tokenizer
from tests.services.engine.helpers import make_engine, random_prompts, write_pair
from tests.services.engine.tokenizer_helpers import trained_bpe, write_folder

TEXT = "the quick brown fox jumps over the lazy dog, the quick brown fox"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(str(write_folder(tmp_path_factory.mktemp("bpe"), trained_bpe())))


def _stream(out: StepOutputs, ids: list[int], sampling: SamplingParams) -> tuple[Request, list]:
    """Append ids a token a step, as a decode worker without drafts emits them."""
    req, outputs = Request("r", [1], sampling, None), []
    req.status = Status.DECODE
    for t in ids:
        out.append(req, [t])
        if req.finish_reason is not None:
            req.status = Status.FINISHED
            out.finish(req)
        outputs += out.flush()
        if req.finish_reason is not None:
            break
    return req, outputs


@pytest.mark.parametrize("stop", [(), ("brown fox j",)], ids=["no-stop", "stop-string"])
def test_without_text_the_tokens_and_stops_are_the_same(tok, stop):
    ids = tok.encode(TEXT, add_special_tokens=False)
    sampling = SamplingParams(max_tokens=len(ids) - 2, stop=stop)
    with_text = _stream(StepOutputs(tok, frozenset(), False), ids, sampling)
    without = _stream(StepOutputs(tok, frozenset(), False, delta=True), ids, sampling)
    (req_a, outs_a), (req_b, outs_b) = with_text, without
    assert req_b.output_ids == req_a.output_ids and req_b.finish_reason == req_a.finish_reason
    assert req_a.finish_reason == ("stop" if stop else "length")
    assert [o.new_token_ids for o in outs_b] == [o.new_token_ids for o in outs_a]
    assert [o.token_ids for o in outs_b] == [o.new_token_ids for o in outs_a]  # a step's alone
    assert outs_a[-1].text and all(o.text == "" for o in outs_b)
    if stop:  # matched on the text all the same
        assert req_b.stop_text_len == req_a.stop_text_len is not None


@pytest.mark.parametrize("logprobs", [None, 2])
def test_an_engines_deltas_joined_equal_its_cumulative_outputs(tmp_path, logprobs):
    pair = write_pair(tmp_path)
    prompts = random_prompts(3, seed=5)
    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=logprobs)
    expected = make_engine(pair, k=2).generate(prompts, sampling)
    engine = make_engine(pair, k=2, output_kind="delta")
    ids = [engine.add_request(p, sampling) for p in prompts]
    joined = {i: ([], []) for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.token_ids == out.new_token_ids and out.text == ""
            joined[out.request_id][0].extend(out.token_ids)
            joined[out.request_id][1].extend(out.logprobs or [])
    assert [joined[i][0] for i in ids] == [o.token_ids for o in expected]
    assert [joined[i][1] for i in ids] == [o.logprobs or [] for o in expected]
    assert any(o.text for o in expected)


def test_an_unknown_output_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="output_kind: must be one of"):
        make_engine(write_pair(tmp_path), k=0, output_kind="final")


@pytest.mark.parametrize(("k", "interval"), [(0, 4), (2, 5)])
def test_a_stream_interval_gathers_the_same_tokens_into_fewer_outputs(tmp_path, k, interval):
    """The first token at once, then outputs of at least ``interval`` tokens but the last,
    joined equal to the interval-1 stream, logprobs included, and an abort mid-hold keeps
    its held tokens."""
    pair = write_pair(tmp_path)
    prompts = random_prompts(3, seed=7)
    sampling = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, logprobs=1)
    expected = make_engine(pair, k=k).generate(prompts, sampling)
    engine = make_engine(pair, k=k, output_kind="delta", stream_interval=interval)
    ids = [engine.add_request(p, sampling) for p in prompts]
    pieces: dict[str, list[list[int]]] = {i: [] for i in ids}
    logprobs: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            pieces[out.request_id].append(out.new_token_ids)
            logprobs[out.request_id].extend(out.logprobs)
    for i, want in zip(ids, expected, strict=True):
        assert [t for p in pieces[i] for t in p] == want.token_ids
        assert logprobs[i] == want.logprobs
        first, *middle, last = pieces[i]
        assert len(first) == 1 and all(len(p) >= interval for p in middle) and last
        assert len(pieces[i]) < len(want.token_ids)


def test_an_abort_returns_the_tokens_a_stream_interval_held(tmp_path):
    pair = write_pair(tmp_path)
    sampling = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = make_engine(pair, k=0).generate([[3, 1, 4, 1, 5]], sampling)[0].token_ids
    engine = make_engine(pair, k=0, output_kind="delta", stream_interval=8)
    rid = engine.add_request([3, 1, 4, 1, 5], sampling)
    got: list[int] = []
    for _ in range(6):  # the first token, then five held
        got += [t for out in engine.step() for t in out.new_token_ids]
    assert got == expected[:1]
    engine.abort(rid)
    final = engine.step()
    assert [o.finished for o in final] == [True] and final[0].finish_reason == "abort"
    assert got + final[0].new_token_ids == expected[:6]
    assert not engine.has_unfinished()


def test_a_stream_interval_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="^stream_interval: must be > 0"):
        make_engine(write_pair(tmp_path), k=0, stream_interval=0)
