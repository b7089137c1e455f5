"""Disaggregated serving equals aggregated serving, token for token and in AL.

A router, a prefill and a decode process on 127.0.0.1 serve a tiny random pair whose
drafter has an 8-token window; prompts run past the window, so the decode side's
drafter depends on the draft pages that crossed over UCX.
"""

from __future__ import annotations

import pytest
import torch

from proto.tandem.v1 import client_pb2 as cpb
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling import SamplingParams
from tests.e2e.conftest import (
    ENGINE,
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
    engine = Engine(EngineConfig(model=str(tiny_pair[0]), drafter=str(tiny_pair[1]),
                                 num_spec_tokens=K, **ENGINE))
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
