"""Engine behaviour: concurrency, page pressure, bad input, stop rules, abort, the
disaggregated hooks."""

from __future__ import annotations

import pytest
import torch

from kvcore.aux_state import AuxState
from services.engine.checks import RequestExists
from services.engine.sampling.params import SamplingParams
from tests.services.engine.helpers import GREEDY, assert_pools_empty, make_engine, random_prompts

LONG = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def run_streaming(engine, prompts, params):
    """Step until done; returns {request_id: (final output, concatenated new tokens)}."""
    ids = [engine.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
    streamed = {i: [] for i in ids}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in final, "an output after the finished one"
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out
    return [(final[i], streamed[i]) for i in ids]


def test_32_concurrent_mixed_requests_complete_and_free_their_pages(pair):
    engine = make_engine(pair, k=3, max_num_seqs=32)
    prompts = random_prompts(32, seed=11, max_len=60)
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            top_p=1.0 if i % 3 else 0.9,
            max_tokens=1 + i % 29,
            seed=i,
            ignore_eos=True,
        )
        for i in range(32)
    ]
    results = run_streaming(engine, prompts, params)
    for (out, streamed), p, sp in zip(results, prompts, params, strict=True):
        assert out.finish_reason == "length"
        assert streamed == out.token_ids and len(out.token_ids) == sp.max_tokens
        assert out.usage.prompt_tokens == len(p)
        assert out.usage.completion_tokens == sp.max_tokens
    assert_pools_empty(engine)


def test_page_pressure_queues_and_preempts_without_crashing(pair):
    prompts = random_prompts(12, seed=12, min_len=16, max_len=24)
    expected = [o.token_ids for o in make_engine(pair, k=0).generate(prompts, LONG)]
    engine = make_engine(pair, k=3, num_pages=(40, 40))  # ~3 requests' worth of pages
    outputs = engine.generate(prompts, LONG)
    assert [o.token_ids for o in outputs] == expected
    assert engine.scheduler.num_preemptions > 0
    # cached tokens are the first admission's (none: no prompt shares a page), not the
    # re-admission's match over the prompt and the tokens generated before preemption
    assert [o.usage.cached_tokens for o in outputs] == [{"target": 0, "draft": 0}] * len(prompts)
    assert_pools_empty(engine)


def test_preempted_sampled_requests_still_complete(pair):
    prompts = random_prompts(10, seed=13, min_len=16, max_len=24)
    params = [SamplingParams(temperature=1.0, max_tokens=20, seed=i) for i in range(10)]
    engine = make_engine(pair, k=2, num_pages=(36, 36))
    outputs = engine.generate(prompts, params)
    assert all(o.finished for o in outputs)
    assert engine.scheduler.num_preemptions > 0
    assert_pools_empty(engine)


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ("", None, "prompt"),
        ([], None, "prompt"),
        ([1, 99], None, "prompt"),  # token id outside the vocabulary
        ([1, -1], None, "prompt"),  # negative
        ([1, 2.0], None, "prompt"),  # not an integer
        ([1, "2"], None, "prompt"),
        ([1] * 512, None, "prompt"),  # as long as the context
        ([1] * 500, SamplingParams(max_tokens=13), "max_tokens"),
        ([1, 2], "greedy", "sampling"),
    ],
)
def test_bad_input_names_the_field_and_the_engine_goes_on(pair, prompt, params, field):
    engine = make_engine(pair, k=2)
    with pytest.raises(ValueError, match=f"^{field}:"):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()
    out = engine.generate([[1, 2, 3]], GREEDY)[0]
    assert out.finished and len(out.token_ids) > 0


def test_duplicate_request_id_is_refused(pair):
    engine = make_engine(pair, k=2)
    engine.add_request([1, 2], GREEDY, request_id="a")
    with pytest.raises(ValueError, match="^request_id:"):
        engine.add_request([3, 4], GREEDY, request_id="a")


def test_stop_token_and_stop_string_cut_the_output(pair):
    prompt = random_prompts(1, seed=14, min_len=10, max_len=10)[0]
    full = make_engine(pair, k=0).generate([prompt], LONG)[0].token_ids
    engine = make_engine(pair, k=4)
    by_token = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=(full[5],))
    out = engine.generate([prompt], by_token)[0]
    assert out.finish_reason == "stop" and out.token_ids == full[: full.index(full[5]) + 1]
    stop = "".join(chr(t) for t in full[6:8])
    by_text = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=(stop,))
    out = engine.generate([prompt], by_text)[0]
    text = "".join(chr(t) for t in full)
    cut = text.index(stop)
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert out.token_ids == full[: cut + len(stop)]
    assert_pools_empty(engine)


def test_eos_stops_unless_ignored(pair):
    eos = 31
    prompts = random_prompts(40, seed=15)
    full = make_engine(pair, k=0).generate(prompts, LONG)
    i = next(i for i, o in enumerate(full) if eos in o.token_ids)
    out = make_engine(pair, k=3).generate([prompts[i]], SamplingParams(temperature=0.0, max_tokens=24))[0]
    cut = full[i].token_ids.index(eos) + 1
    assert out.finish_reason == "stop" and out.token_ids == full[i].token_ids[:cut]


def test_seeded_sampling_is_reproducible(pair):
    prompts = random_prompts(6, seed=16)
    params = [
        SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=100 + i, ignore_eos=True)
        for i in range(6)
    ]
    a = [o.token_ids for o in make_engine(pair, k=3).generate(prompts, params)]
    b = [o.token_ids for o in make_engine(pair, k=3).generate(prompts, params)]
    assert a == b
    other = [SamplingParams(temperature=1.0, max_tokens=16, seed=200 + i, ignore_eos=True) for i in range(6)]
    assert [o.token_ids for o in make_engine(pair, k=3).generate(prompts, other)] != a


def test_abort_running_and_waiting_requests(pair):
    engine = make_engine(pair, k=2, max_num_seqs=2)
    ids = [engine.add_request(p, LONG) for p in random_prompts(4, seed=17)]
    engine.step()  # two admitted, two waiting
    assert engine.abort(ids[0]) and engine.abort(ids[3])
    assert not engine.abort("nope")
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final[ids[0]].finish_reason == "abort" and final[ids[3]].finish_reason == "abort"
    assert final[ids[1]].finish_reason == final[ids[2]].finish_reason == "length"
    assert_pools_empty(engine)


def test_target_only_mode_reports_one_token_per_step(pair):
    out = make_engine(pair, k=0).generate([[1, 2, 3]], LONG)[0]
    assert out.usage.acceptance_length == 1.0


def transfer(prefill_engine, decode_engine, request_id: str, num_tokens: int) -> None:
    """Copy a parked request's pages into the decode engine's reservation, group by group."""
    src = prefill_engine.manager.transfer_pages(request_id, num_tokens)
    dst = decode_engine.manager.transfer_pages(request_id, num_tokens)
    for group, pages in src.items():
        assert dst[group].first_page == pages.first_page
        src_pool, dst_pool = prefill_engine.kv_pools.tensor(group), decode_engine.kv_pools.tensor(group)
        dst_pool[dst[group].page_ids] = src_pool[pages.page_ids]


@pytest.mark.parametrize("prompt_len", [5, 30])  # inside and past the draft window
def test_prefill_only_then_decode_elsewhere_matches_aggregated(pair, prompt_len):
    prompt = random_prompts(1, seed=18, min_len=prompt_len, max_len=prompt_len)[0]
    expected = make_engine(pair, k=3).generate([prompt], LONG)[0].token_ids
    prefill, decode = make_engine(pair, k=3), make_engine(pair, k=3)
    rid = prefill.add_request(prompt, LONG, prefill_only=True)
    outs = []
    while not outs:  # chunks that do not finish the prompt report nothing
        outs = prefill.step()
    out = outs[0]
    assert out.finish_reason == "prefilled" and out.aux.prompt_len == prompt_len
    assert out.aux.first_token_id == expected[0] and out.aux.hidden.shape == (64,)
    assert decode.reserve(rid, prompt_len, prompt) is not None
    transfer(prefill, decode, rid, prompt_len)
    prefill.release(rid)
    decode.add_prefilled(rid, prompt, out.aux, LONG)
    final = []
    while decode.has_unfinished():
        final += [o for o in decode.step() if o.finished]
    assert final[0].token_ids == expected
    assert decode.stats["transferred"].num_steps > 0
    assert_pools_empty(prefill)
    assert_pools_empty(decode)


@pytest.mark.parametrize(
    "prompt_len,prompt_ids,message",
    [
        (0, [], "prompt_len: must be >= 1"),
        (512, [], "prompt_len: 512 leaves no room in the context of 512"),
        (3, [1, 2], "prompt_token_ids: 2 tokens, prompt_len is 3"),
        (2, [1, 99], "prompt_token_ids: 99 is outside the vocabulary of 32"),
    ],
)
def test_a_reservation_the_engine_can_never_take_is_refused(pair, prompt_len, prompt_ids, message):
    engine = make_engine(pair, k=2)
    with pytest.raises(ValueError, match=f"^{message}$"):
        engine.reserve("r", prompt_len, prompt_ids)
    assert not engine.holds_reservation("r")


def test_a_reservation_is_held_until_released_or_taken_over(pair):
    engine = make_engine(pair, k=2)
    res = engine.reserve("r", 5, [1, 2, 3, 4, 5])
    assert res is not None and set(res.block_tables) == {"target", "draft"}
    assert engine.holds_reservation("r")
    with pytest.raises(RequestExists, match="^request_id: 'r' is reserved$"):
        engine.check_reserve("r", 5)
    assert engine.release_reservation("r") and not engine.release_reservation("r")
    engine.reserve("s", 2)
    engine.add_prefilled("s", [1, 2], AuxState(2, 3, torch.zeros(64)), GREEDY)
    assert not engine.holds_reservation("s") and not engine.release_reservation("s")
    while engine.has_unfinished():
        engine.step()
    assert_pools_empty(engine)


def test_add_prefilled_needs_a_reservation(pair):
    engine = make_engine(pair, k=2)
    with pytest.raises(ValueError, match="^request_id:"):
        engine.add_prefilled("x", [1, 2], AuxState(2, 3, torch.zeros(64)), GREEDY)


def test_generate_is_all_or_nothing_on_bad_input(pair):
    engine = make_engine(pair, k=2)
    with pytest.raises(ValueError, match="^prompt:"):
        engine.generate([[1, 2], [3], []], GREEDY)
    assert {o.finish_reason for o in engine.step()} == {"abort"}
    assert not engine.has_unfinished()
    assert_pools_empty(engine)


def test_a_given_first_token_replaces_the_sampled_one_and_the_rest_continues_from_it(pair):
    """A retried prefill keeps the token a client already has: with ``first_token_id`` the
    first token is that one (its logprobs with it), and greedy decoding goes on as for the
    prompt followed by it; outside the vocabulary it is refused naming the field."""
    prompt = random_prompts(1, seed=21, min_len=12, max_len=12)[0]
    sampled = make_engine(pair, k=3).generate([prompt], LONG)[0].token_ids
    forced = (sampled[0] + 1) % 31  # not the sampled token, nor EOS (31)
    continued = (
        make_engine(pair, k=3)
        .generate([[*prompt, forced]], SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True))[0]
        .token_ids
    )
    engine = make_engine(pair, k=3)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    rid = engine.add_request(prompt, with_logprobs, first_token_id=forced)
    final = []
    while engine.has_unfinished():
        final += [o for o in engine.step() if o.finished and o.request_id == rid]
    assert final[0].token_ids == [forced, *continued]
    assert final[0].logprobs[0].token_id == forced
    with pytest.raises(ValueError, match=r"first_token_id: 32 is outside the vocabulary \[0, 32\)"):
        engine.add_request(prompt, LONG, first_token_id=32)
    assert_pools_empty(engine)
