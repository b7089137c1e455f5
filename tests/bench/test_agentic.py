"""The agentic replay benchmark: its workload's promises, its arithmetic, and a tiny replay
against a real local cluster (router, prefill and decode processes on 127.0.0.1)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from bench import agentic_svg
from bench.agentic_floor import PromptCacheFloor, common_prefix_len
from bench.agentic_replay import ReplayResult, TurnRecord, replay
from bench.agentic_report import forward_tokens, markdown_table, percentile, summarize
from bench.agentic_workload import ThreadState, Workload, WorkloadConfig, generate
from tests.e2e import conftest as e2e

byte_pair = e2e.byte_pair  # the session fixture: a random pair over the byte vocabulary

TINY = WorkloadConfig(
    conversations=2,
    min_turns=2,
    max_turns=2,
    answer_tokens=8,
    preambles=1,
    preamble_tokens=64,
    first_tokens=(16, 32),
    turn_tokens=(16, 32),
    branch_probability=0.0,
    max_context=512,
)


def fake_answer(name: str, turn: int, length: int) -> tuple[int, ...]:
    return tuple((7 * turn + 3 * len(name) + i) % 256 for i in range(length))


def play(workload: Workload) -> dict[str, ThreadState]:
    """Every thread's prompts with made-up answers, branches after their fork turn."""
    states: dict[str, ThreadState] = {}
    for thread in workload.threads:  # conversations come before their branches
        base = states[thread.parent].fork_base(thread.fork_turn) if thread.is_branch else thread.head
        state = states[thread.name] = ThreadState(thread, base)
        for turn in range(thread.turns):
            state.next_prompt()
            state.record(fake_answer(thread.name, turn, workload.config.answer_tokens))
    return states


def test_the_same_seed_gives_the_same_workload_and_another_seed_another():
    assert generate(WorkloadConfig(seed=3)) == generate(WorkloadConfig(seed=3))
    assert generate(WorkloadConfig(seed=3)).threads != generate(WorkloadConfig(seed=4)).threads


def test_each_turn_extends_the_previous_prompt_and_answer_within_the_context():
    config = WorkloadConfig()
    workload = generate(config)
    for state in play(workload).values():
        for t in range(1, state.thread.turns):
            previous = state.prompts[t - 1] + state.answers[t - 1]
            assert state.prompts[t][: len(previous)] == previous
            assert len(state.prompts[t]) > len(previous)
        assert len(state.prompts[-1]) + config.answer_tokens <= config.max_context
    for conversation in workload.conversations():
        assert config.min_turns <= conversation.turns <= config.max_turns


def test_conversations_share_preambles_and_branches_share_their_fork_prefix():
    workload = generate(WorkloadConfig(conversations=6, branch_probability=1.0))
    states = play(workload)
    heads = {t.head for t in workload.conversations()}
    assert len(heads) == workload.config.preambles
    branches = [t for t in workload.threads if t.is_branch]
    assert len(branches) >= 2 * len(workload.conversations())
    for branch in branches:
        parent = states[branch.parent]
        fork = parent.prompts[branch.fork_turn] + parent.answers[branch.fork_turn]
        assert branch.fork_turn < parent.thread.turns - 1  # the parent goes on after the fork
        assert states[branch.name].prompts[0][: len(fork)] == fork
        siblings = workload.branches_of(branch.parent, branch.fork_turn)
        assert len(siblings) >= 2


def test_the_summary_counts_prefilled_as_prompt_minus_cached_per_group():
    records = [
        TurnRecord(
            "c0",
            0,
            "first",
            prompt_tokens=100,
            cached_per_group={"target": 0},
            completion_tokens=8,
            acceptance_length=2.0,
            num_drafts=4,
            ttft_s=0.5,
            itl_s=[0.1, 0.3],
        ),
        TurnRecord(
            "c0",
            1,
            "continuation",
            prompt_tokens=200,
            floor_cached=150,
            cached_per_group={"target": 96, "draft": 64},
            completion_tokens=8,
            acceptance_length=4.0,
            num_drafts=2,
            ttft_s=0.1,
            itl_s=[0.2],
        ),
        TurnRecord("c1", 0, "first", prompt_tokens=50, error="UNAVAILABLE: gone"),
    ]
    s = summarize("x", "transferred", ReplayResult(records, wall_s=2.0), rebuild_tokens=10)
    assert (s.requests, s.errors, s.prompt_tokens) == (3, 1, 300)
    assert (s.prefilled("target"), s.prefilled("draft")) == (204, 236)
    assert s.floor_prefilled == 100 + 50
    assert s.forward_tokens == 100 + (200 - (96 - 10 - 1))  # the draft window is rebuilt
    records[1].cached_per_group["draft"] = 96
    assert forward_tokens(records[1], 10) == 200 - 96 + 1  # reused: one position for features
    assert s.hit_rate("target") == pytest.approx(0.32)
    assert s.al == pytest.approx((2.0 * 4 + 4.0 * 2) / 6)
    assert s.al_continuation == pytest.approx(4.0)
    assert s.ttft_first[0] == pytest.approx(0.5) and s.ttft_continuation[0] == pytest.approx(0.1)
    assert s.itl[0] == pytest.approx(0.2) and s.output_tok_s == pytest.approx(8.0)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    table = markdown_table([s], {"y": "no host tier flag"})
    assert len({line.count("|") for line in table.splitlines()}) == 1
    ET.fromstring(agentic_svg.render([s, s], "title"))  # well-formed


def test_the_floor_reuses_whole_pages_of_earlier_prompts_and_leaves_one_token():
    assert common_prefix_len((1, 2, 3, 4), (1, 2, 9)) == 2
    assert common_prefix_len((), (1,)) == 0 and common_prefix_len((5, 6), (5, 6)) == 2
    floor = PromptCacheFloor(tokens_per_page=4)
    assert floor.best_hit(tuple(range(10))) == 0
    floor.add(tuple(range(10)))  # caches pages [0, 8)
    assert floor.best_hit(tuple(range(20))) == 8
    assert floor.best_hit((0, 1, 2, 7)) == 3
    assert floor.best_hit(tuple(range(8))) == 7  # the last prompt token is computed


@pytest.mark.slow
def test_a_tiny_replay_reuses_the_prefix_on_the_continuation_turn(byte_pair):
    workload = generate(TINY)
    cluster = e2e.start_cluster(byte_pair, ["prefill", "decode"])
    try:
        result = replay(cluster.router_address, workload, concurrency=2, tokens_per_page=e2e.PAGE)
    finally:
        cluster.stop()
    assert [r.error for r in result.records] == [""] * 4
    assert all(r.completion_tokens == TINY.answer_tokens for r in result.records)
    continuations = [r for r in result.records if r.kind == "continuation"]
    assert len(continuations) == 2
    assert all(r.cached_per_group["target"] > 0 for r in continuations)
    assert all(0 < r.cached_per_group["target"] <= r.floor_cached for r in continuations)
    assert all(r.ttft_s > 0 and r.acceptance_length >= 1 for r in result.records)
