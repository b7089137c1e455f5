"""The per-step K rule (adaptive_k.py): draft iff AL * t_plain >= t_spec, probes of the
other kind, and greedy output equal to target-only whatever it picks."""

from __future__ import annotations

from services.engine.adaptive_k import AdaptiveK
from services.engine.sampling import SamplingParams
from tests.services.engine.helpers import make_engine, random_prompts
from tests.services.engine.test_cuda_graphs import GREEDY, with_static_path


def test_drafts_until_both_costs_are_known():
    rule = AdaptiveK(k=4, max_batch=16)
    assert rule.choose(3) == 4  # nothing measured: draft
    rule.record(3, 4, 0.100, 3 * 3)  # the first step of a kind is not counted
    assert rule.choose(3) == 4
    rule.record(3, 4, 0.006, 3 * 3)  # AL 3 at 6 ms
    assert rule.choose(3) == 0  # plain cost unknown in this bucket: measure it
    rule.record(3, 0, 0.100, 3)
    assert rule.choose(3) == 0
    rule.record(3, 0, 0.002, 3)
    assert rule.choose(4) == 4  # 3 * 2 ms >= 6 ms: drafting pays (ties draft)
    assert rule.choose(5) == 4  # bucket 8 is measured on its own


def test_stops_drafting_when_it_does_not_pay_and_probes_back():
    rule = AdaptiveK(k=4, max_batch=64, probe_every=4, smoothing=1.0)
    for _ in range(2):  # the first of each kind is not counted
        rule.record(64, 4, 0.010, 64 * 1)  # AL 1: every draft rejected
    for _ in range(2):
        rule.record(64, 0, 0.004, 64)
    picks = []
    for _ in range(10):
        k = rule.choose(64)
        picks.append(k)
        rule.record(64, k, 0.010 if k else 0.004, 64)
    assert picks == [0, 0, 4, 0, 0, 0, 0, 4, 0, 0]  # a probe after every 4 plain steps in a row


def test_a_probe_that_finds_drafting_pays_keeps_drafting():
    rule = AdaptiveK(k=2, max_batch=8, probe_every=3, smoothing=1.0)
    for _ in range(2):
        rule.record(8, 2, 0.006, 8 * 1)
    rule.record(8, 0, 0.004, 8)
    rule.record(8, 0, 0.004, 8)  # a run of two plain steps
    assert rule.choose(8) == 0
    rule.record(8, 0, 0.004, 8)
    assert rule.choose(8) == 2  # probe
    rule.record(8, 2, 0.006, 8 * 3)  # acceptance came back: AL 3
    assert rule.choose(8) == 2 and rule.choose(8) == 2


def test_plain_steps_keep_greedy_output_and_count_no_drafts(pair):
    prompts = random_prompts(4, seed=61, max_len=30)
    plain = make_engine(pair, k=0).generate(prompts, GREEDY)
    engine = with_static_path(make_engine(pair, k=3))
    engine.adaptive = rule = AdaptiveK(k=3, max_batch=8, probe_every=3)
    for bucket in (1, 2, 4):  # costs that make every drafting step lose
        for _ in range(2):
            rule.record(bucket, 3, 1.0, bucket)
            rule.record(bucket, 0, 1e-9, bucket)
    out = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    stats = engine.stats["local"]
    assert rule.plain_steps > 3 + 6 and rule.spec_steps > 3 + 1  # probes drafted
    assert engine.runner.graphs.plain.replays  # steps without drafts took the greedy path too
    assert stats.num_draft_tokens < 3 * stats.num_steps  # plain steps counted no drafts


def test_sampled_batches_keep_k_so_seeded_outputs_do_not_depend_on_timings(pair):
    sampled = SamplingParams(temperature=0.9, max_tokens=16, seed=7, ignore_eos=True)
    prompts = random_prompts(3, seed=62, max_len=20)
    fixed = with_static_path(make_engine(pair, k=3)).generate(prompts, sampled)
    engine = with_static_path(make_engine(pair, k=3))
    engine.adaptive = rule = AdaptiveK(k=3, max_batch=8)
    for bucket in (1, 2, 4):  # costs that would stop drafting
        for _ in range(2):
            rule.record(bucket, 3, 1.0, bucket)
            rule.record(bucket, 0, 1e-9, bucket)
    before = rule.plain_steps
    out = engine.generate(prompts, sampled)
    assert [o.token_ids for o in out] == [o.token_ids for o in fixed]
    assert rule.plain_steps == before  # the rule was never asked
