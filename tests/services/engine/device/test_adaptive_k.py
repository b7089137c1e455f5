"""The per-step K rule (adaptive_k.py): draft iff AL * t_plain >= t_spec (each the least
recent time of its kind), probes of the other kind, and greedy output equal to
target-only whatever it picks."""

from __future__ import annotations

from services.engine.device.adaptive_k import AdaptiveK
from services.engine.sampling.params import SamplingParams
from tests.services.engine.device.test_cuda_graphs import GREEDY, with_static_path
from tests.services.engine.helpers import assert_pools_empty, make_engine, random_prompts


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


def test_one_slow_step_does_not_stop_drafting():
    """A step's cost is the least of its kind's recent times: noise only adds to a step,
    so one slow step (a first call, a pause) does not make drafting look dear."""
    rule = AdaptiveK(k=4, max_batch=16, window=4)
    rule.record(16, 4, 0.002, 16 * 3)  # first of its kind: not counted
    rule.record(16, 4, 0.050, 16 * 3)  # one slow step
    rule.record(16, 4, 0.002, 16 * 3)
    rule.record(16, 0, 0.001, 16)
    rule.record(16, 0, 0.001, 16)
    assert rule.choose(16) == 4  # AL 3 x 1 ms >= 2 ms, the 50 ms step notwithstanding
    for _ in range(4):  # the window moves on: four dear steps in a row are the cost now
        rule.record(16, 4, 0.004, 16 * 3)
    assert rule.costs[16].spec_s == 0.004 and rule.choose(16) == 0


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


class Scripted:
    """A K rule that drafts on the steps ``pattern`` marks (cycled)."""

    def __init__(self, k: int, pattern: str) -> None:
        self.k, self.pattern, self.steps = k, pattern, 0

    def choose(self, batch: int) -> int:
        self.steps += 1
        return self.k if self.pattern[(self.steps - 1) % len(self.pattern)] == "k" else 0

    def record(self, batch: int, k: int, seconds: float, tokens: int) -> None:
        pass


# stretches without drafts of 3 (under the lag limit) and 20 (past it: caught up midway)
PATTERN = "kk" + "." * 3 + "kkk" + "." * 20 + "k"


def test_a_catch_up_left_for_later_gives_the_same_drafts(pair, monkeypatch):
    """Steps without drafts leave the drafter's catch-up for later, up to LAG_TOKENS
    pending slots; the step that drafts next catches them up in one replay, and drafts
    exactly what catching up every step drafts."""
    prompts = random_prompts(4, seed=63, min_len=20, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    runs, lagged = {}, {}
    for lag in (True, False):
        engine = with_static_path(make_engine(pair, k=3))
        engine.adaptive = Scripted(3, PATTERN)
        drafts = record_drafts(engine)
        if not lag:
            monkeypatch.setattr(
                "services.engine.device.device_step.lags_catch_up", lambda graphs, decode: False
            )
        out = engine.generate(prompts, params)
        stats = engine.stats["local"]
        runs[lag] = ([o.token_ids for o in out], drafts, stats.num_draft_tokens, stats.num_accepted)
        lagged[lag] = sum(engine.runner.graphs.lagged.replays.values())  # prefill chunks too
        assert_pools_empty(engine)
    assert lagged[True] > lagged[False]  # catch-ups over the slots lagging steps left
    assert runs[True] == runs[False]
    assert len(runs[True][1]) > 10


def record_drafts(engine) -> list[list[list[int]]]:
    """Every draft-chain run's drafts, [run][request][K], appended as the engine steps."""
    chain, seen = engine.runner.graphs.chain, []
    run = chain.run

    def recorded(*args, **kwargs):
        out = run(*args, **kwargs)
        seen.append(out[0].tolist())
        return out

    chain.run = recorded
    return seen
