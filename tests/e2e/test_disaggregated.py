"""Disaggregated serving equals aggregated serving, token for token and in AL.

A router, a prefill and a decode process on 127.0.0.1 serve a tiny random pair whose
drafter has an 8-token window; prompts run past the window, so the decode side's
drafter depends on the draft pages that crossed over UCX.
"""

from __future__ import annotations

import time

import pytest
import torch

from proto.tandem.v1 import client_pb2 as cpb
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling.params import SamplingParams
from tests.e2e.conftest import (
    ENGINE,
    PAGE,
    K,
    assert_no_request_holds_pages,
    generate,
    start_cluster,
)

pytestmark = pytest.mark.slow
LENGTHS = (3, 9, 17, 33, 60)
MAX_TOKENS = 24


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 31, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def aggregated(tiny_pair):
    """Reference: one in-process engine, one request at a time."""
    engine = Engine(
        EngineConfig(model=str(tiny_pair[0]), drafter=str(tiny_pair[1]), num_spec_tokens=K, **ENGINE)
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [engine.generate([p], greedy)[0] for p in prompts()]


@pytest.fixture(scope="module")
def unified(tiny_pair):
    cluster = start_cluster(tiny_pair, ["prefill", "decode"], "unified")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def separate(tiny_pair):
    cluster = start_cluster(tiny_pair, ["prefill", "decode"], "separate")
    yield cluster
    cluster.stop()


def test_unified_equals_aggregated_token_for_token_and_in_al(unified, aggregated):
    for prompt, ref in zip(prompts(), aggregated, strict=True):
        tokens, complete = generate(unified.router_address, prompt, MAX_TOKENS)
        assert tokens == ref.token_ids, len(prompt)
        assert complete.usage.acceptance_length == pytest.approx(ref.usage.acceptance_length)
        assert complete.usage.prompt_tokens == len(prompt)
        assert complete.usage.completion_tokens == len(tokens)
        moved = {t.group: t.num_bytes for t in complete.usage.transfers}
        assert set(moved) == {"target", "draft"}
        assert moved["target"] > 0 and moved["draft"] > 0
    assert_no_request_holds_pages(unified)


def test_a_seeded_sampled_request_draws_what_it_draws_aggregated(unified, tiny_pair):
    """Draws are keyed by seed and position, so the prefill worker's first token and the
    decode worker's continuation are the tokens one engine samples for the same seed."""
    engine = Engine(
        EngineConfig(model=str(tiny_pair[0]), drafter=str(tiny_pair[1]), num_spec_tokens=K, **ENGINE)
    )
    for i, prompt in enumerate(prompts()[:3]):
        params = SamplingParams(
            temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, seed=100 + i, ignore_eos=True
        )
        ref = engine.generate([prompt], params)[0].token_ids
        tokens, _ = generate(
            unified.router_address,
            prompt,
            MAX_TOKENS,
            temperature=0.9,
            top_p=0.95,
            seed=100 + i,
            ignore_eos=True,
        )
        assert tokens == ref, len(prompt)
    assert_no_request_holds_pages(unified)


def test_separate_layout_is_lossless_but_moves_no_draft_pages(separate, aggregated):
    for prompt, ref in zip(prompts(), aggregated, strict=True):
        tokens, complete = generate(separate.router_address, prompt, MAX_TOKENS)
        assert tokens == ref.token_ids, len(prompt)
        assert {t.group for t in complete.usage.transfers} == {"target"}
    assert_no_request_holds_pages(separate)


def test_finish_at_the_first_token_releases_the_reservation(unified):
    tokens, complete = generate(unified.router_address, prompts()[1], max_tokens=1)
    assert len(tokens) == 1
    assert complete.finish_reason == cpb.FINISH_REASON_LENGTH
    assert_no_request_holds_pages(unified)


def test_a_repeated_prompt_reports_its_cached_tokens_per_group(unified):
    prompt = prompts()[4]  # 60 tokens, past the drafter's 8-token window
    generate(unified.router_address, prompt, 4)
    _, complete = generate(unified.router_address, prompt, 4)
    cached = {g.group: g.num_tokens for g in complete.usage.cached_tokens_per_group}
    assert complete.usage.cached_tokens == len(prompt) - 1  # all but the last prompt token
    assert cached == {"target": len(prompt) - 1, "draft": len(prompt) - 1}
    assert complete.usage.num_drafts > 0
    assert complete.usage.num_draft_tokens == K * complete.usage.num_drafts


def test_a_continuation_turn_moves_only_the_pages_the_decode_worker_lacks(unified, tiny_pair):
    """Turn 2 extends turn 1's prompt and answer, which the decode worker cached when turn 1
    ended: the reservation names those pages held, and the prefill sends only the rest."""
    engine = Engine(
        EngineConfig(model=str(tiny_pair[0]), drafter=str(tiny_pair[1]), num_spec_tokens=K, **ENGINE)
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    first = [t + 1 for t in prompts()[3]]  # 33 tokens no other test sends
    answer, _ = generate(unified.router_address, first, MAX_TOKENS)
    second = first + answer + [3, 1, 4, 1, 5]
    tokens, complete = generate(unified.router_address, second, MAX_TOKENS)
    ref1 = engine.generate([first], greedy)[0]
    ref2 = engine.generate([second], greedy)[0]
    assert answer == ref1.token_ids
    assert tokens == ref2.token_ids
    assert complete.usage.acceptance_length == pytest.approx(ref2.usage.acceptance_length)
    held = ref2.usage.cached_tokens["target"] // PAGE  # what the aggregated engine reused
    assert held > len(first) // PAGE  # turn 1's answer is held too
    moved = {t.group: (t.num_held_pages, t.num_pages) for t in complete.usage.transfers}
    last_page = (len(second) - 1) // PAGE
    assert moved == {"target": (held, last_page + 1 - held), "draft": (held, last_page + 1 - held)}
    assert_no_request_holds_pages(unified)


def test_the_router_sends_a_continuation_to_the_decode_worker_that_holds_it(tiny_pair):
    """Two decode workers: turn 2 goes back to turn 1's (fewest pages to move, after the
    Stats polls have seen turn 1's pages cached there), and skips what it holds."""
    cluster = start_cluster(tiny_pair, ["prefill", "decode", "decode"])
    try:
        first = [(t + 2) % 31 for t in prompts()[4]]  # 60 tokens no other test sends
        answer, one = generate(cluster.router_address, first, MAX_TOKENS)
        assert all(t.num_held_pages == 0 for t in one.usage.transfers)
        time.sleep(1.5)  # a few Stats polls
        second = first + answer + [5, 6, 7]
        _, two = generate(cluster.router_address, second, MAX_TOKENS)
        held = {t.group: t.num_held_pages for t in two.usage.transfers}
        assert held["target"] == held["draft"] > len(first) // PAGE
        assert_no_request_holds_pages(cluster)
    finally:
        cluster.stop()
