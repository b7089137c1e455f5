"""Overlapped decode steps (``device/overlap.py``) on the CPU, through the uncaptured graph
path: outputs equal the same engine without overlap, and the eager engine, token for token,
across churn (requests joining mid-run, finishing at different lengths, aborted mid-stream,
preempted in a small pool), greedy and sampled, aggregated and continued from a transfer;
pools are empty afterwards. The successor of a step really is launched before that step is
read: the launch order is recorded."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from services.engine import overlapped_steps as steps_module
from services.engine.config import EngineConfig
from services.engine.device import overlap, spec_overlap
from services.engine.device.adaptive_k import AdaptiveK
from services.engine.engine import Engine
from services.engine.sampling.params import SamplingParams
from tests.services.engine.device.test_cuda_graphs import with_static_path
from tests.services.engine.helpers import assert_pools_empty, make_engine, random_prompts
from tests.services.engine.test_engine import transfer

LENGTHS = [5, 24, 9, 17, 24, 3, 12, 20]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def sampled(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.9, top_p=0.95, max_tokens=max_tokens, seed=max_tokens, ignore_eos=True
    )


class Launches(list):
    def __init__(self) -> None:
        super().__init__()
        self.joins: list[tuple[int, int]] = []
        self.behind: dict[int, int] = {}  # event index of a successor -> its predecessor's size
        self.departed = 0  # successors that left out rows of requests gone since


@pytest.fixture
def launches(monkeypatch):
    """("launch", batch) for a first step, ("successor", batch) for one launched behind an
    unread step, ("read", batch) for each read, in order; ``joins``: (batch, rows going on
    from the unread step) of each successor that took requests joined since."""
    events = Launches()

    def record(step, decode, after):
        if step is not None:
            events.append(("successor" if after is not None else "launch", len(decode)))
            if after is not None:
                events.behind[len(events) - 1] = len(after.decode)
                went_on = len(after.going_on())
                events.departed += went_on < len(after.decode)
                if went_on < len(decode):
                    events.joins.append((len(decode), went_on))
        return step

    def launch(graphs, plan, decode, after=None):
        return record(overlap.launch(graphs, plan, decode, after), decode, after)

    def launch_spec(graphs, plan, decode, forced, after=None):
        return record(spec_overlap.launch_spec(graphs, plan, decode, forced, after), decode, after)

    def reader(read):
        def read_step(step):
            events.append(("read", len(step.decode)))
            return read(step)

        return read_step

    monkeypatch.setattr(steps_module, "launch", launch)
    monkeypatch.setattr(steps_module, "launch_spec", launch_spec)
    monkeypatch.setattr(steps_module, "read", reader(overlap.read))
    monkeypatch.setattr(steps_module, "read_spec", reader(spec_overlap.read_spec))
    return events


def churn(engine, prompts, params, abort: int = 4, abort_at: int = 6) -> dict[str, list[int]]:
    """Run ``prompts`` step by step: six at the start, one more at each of the next steps,
    request ``abort`` aborted at step ``abort_at``. Final token ids by request id."""
    ids, final, step = [], {}, 0
    for i in range(6):
        ids.append(engine.add_request(prompts[i], params[i], f"r{i}"))
    while engine.has_unfinished() or len(ids) < len(prompts):
        if len(ids) < len(prompts) and step >= 2:
            i = len(ids)
            ids.append(engine.add_request(prompts[i], params[i], f"r{i}"))
        if step == abort_at:
            engine.abort(f"r{abort}")
        final.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        step += 1
    return final


@pytest.mark.parametrize("k", [0, 3])  # target-only (overlap.py), drafting (spec_overlap.py)
@pytest.mark.parametrize("kind", [greedy, sampled])
@pytest.mark.parametrize("num_pages", [256, 24])  # 24 pages of 4 tokens: preemption under load
def test_overlapped_outputs_equal_synchronous_ones_across_churn(pair, k, kind, num_pages, launches):
    prompts = random_prompts(len(LENGTHS), seed=11, min_len=4, max_len=30)
    params = [kind(n) for n in LENGTHS]
    expected = make_engine(pair, k=k).generate(prompts, params)
    results = {}
    for on in (False, True):
        engine = with_static_path(make_engine(pair, k=k, num_pages=(num_pages, num_pages), overlap=on))
        results[on] = churn(engine, prompts, params)
        if num_pages == 24:
            assert engine.scheduler.num_preemptions > 0, "the page budget should force preemptions"
        assert_pools_empty(engine)
    for i, out in enumerate(expected):
        rid = f"r{i}"
        if i == 4:  # aborted mid-stream: a prefix of its full output, in both
            assert out.token_ids[: len(results[True][rid])] == results[True][rid]
            assert out.token_ids[: len(results[False][rid])] == results[False][rid]
            continue
        assert results[True][rid] == results[False][rid], rid
        if not (k and kind is sampled and num_pages == 24):
            # a preempted request's drafter state is recomputed at another batch shape: its
            # q, so its sampled acceptances, may differ from an unpreempted run's
            assert results[True][rid] == out.token_ids, rid
    successors = [size for event, size in launches if event == "successor"]
    assert max(successors) >= (6 if num_pages == 256 else 1)  # under page pressure: once the queue drains
    for at, behind in launches.behind.items():  # launched while its predecessor was unread
        assert launches[at + 1] == ("read", behind), launches[at - 2 : at + 2]
    if num_pages == 256:
        assert launches.departed  # requests that finished left the next successor


def test_the_successor_is_launched_before_the_step_is_read(pair, launches):
    engine = with_static_path(make_engine(pair, k=0, overlap=True))
    prompts = random_prompts(2, seed=3, min_len=4, max_len=8)
    ids = [engine.add_request(p, greedy(6)) for p in prompts]
    final, kinds = {}, []
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
        kinds.append(engine.last_step)
    expected = make_engine(pair, k=0).generate(prompts, greedy(6))
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in expected]
    assert kinds == ["prefill", *["overlapped"] * 5]  # the kind tandem_engine_step_seconds reports
    decode = [e for e in launches if e[1] == 2]
    # the first token comes from the prefill; five decode steps: the first launched, four
    # successors each launched before its predecessor's read; the last successor runs
    # rows that both requests had already finished: read at once (the engine idles clean)
    assert decode[:3] == [("launch", 2), ("successor", 2), ("read", 2)]
    assert decode.count(("successor", 2)) == 5 and decode.count(("read", 2)) == 6
    assert decode[-2:] == [("read", 2), ("read", 2)]
    assert engine.overlapped.in_flight is None and not engine.overlapped.held
    assert_pools_empty(engine)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("kind", [greedy, sampled])
def test_logprobs_of_overlapped_steps_are_the_synchronous_ones(pair, k, kind, launches):
    """Logprobs are computed on the device before the successor's replay overwrites the
    step's logits: the same values and alternatives as the synchronous step gives, for
    each request's own N, beside requests that ask for none."""
    prompts = random_prompts(4, seed=5, min_len=4, max_len=12)
    base = kind(12)
    params = [base, replace(base, logprobs=2), replace(base, logprobs=0), replace(base, logprobs=5)]
    runs = {}
    for on in (False, True):
        engine = with_static_path(make_engine(pair, k=k, overlap=on))
        runs[on] = [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)]
        assert_pools_empty(engine)
    assert runs[True] == runs[False]
    assert runs[True][0][1] is None and [len(lp[0].top_ids) for _, lp in runs[True][1:]] == [2, 0, 5]
    assert sum(1 for event, _ in launches if event == "successor") > 5  # they did overlap


def decode_side(pair, k: int, prompts, params, overlap: bool) -> dict:
    """The decode side of disaggregated serving: pages reserved (while a step may be in
    flight), filled by a copy, continued with ``add_prefilled`` every two steps, request p3
    aborted at step 7. Final outputs by request id; pools checked empty."""
    prefill = make_engine(pair, k=k)
    decode = with_static_path(make_engine(pair, k=k, overlap=overlap))
    finals, step = {}, 0
    while step < 2 * len(prompts) or decode.has_unfinished():
        if step % 2 == 0 and step // 2 < len(prompts):
            i = step // 2
            rid = prefill.add_request(prompts[i], params[i], f"p{i}", prefill_only=True)
            outs = []
            while not outs:
                outs = prefill.step()
            assert decode.reserve(rid, len(prompts[i]), prompts[i]) is not None
            transfer(prefill, decode, rid, len(prompts[i]))
            prefill.release(rid)
            decode.add_prefilled(rid, prompts[i], outs[0].aux, params[i])
        if step == 7:
            decode.abort("p3")
        finals.update({o.request_id: o for o in decode.step() if o.finished})
        step += 1
    assert_pools_empty(prefill)
    assert_pools_empty(decode)
    return finals


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("kind", [greedy, sampled])
def test_requests_continued_from_transfers_join_overlapped_batches(pair, k, kind, launches):
    """Each arrival joins the batch behind its unread step (drafting: its catch-up span
    from the host, the others' from the device). Outputs equal the aggregated engine's, and
    with a drafter the same drafts are accepted as on a decode side without overlap."""
    prompts = random_prompts(5, seed=18, min_len=9, max_len=20)
    params = [kind(n) for n in (16, 7, 20, 12, 16)]
    expected = make_engine(pair, k=k).generate(prompts, params)
    runs = {on: decode_side(pair, k, prompts, params, on) for on in (False, True)}
    for i, out in enumerate(expected):
        got = runs[True][f"p{i}"]
        if i == 3:  # aborted mid-stream
            assert got.token_ids == out.token_ids[: len(got.token_ids)]
            assert len(got.token_ids) < len(out.token_ids)
            continue
        assert got.token_ids == out.token_ids, i
        before = runs[False][f"p{i}"].usage
        assert (got.usage.num_steps, got.usage.num_accepted) == (before.num_steps, before.num_accepted), i
    assert len(launches.joins) >= 3, launches.joins  # most arrivals joined behind an unread step


@pytest.mark.parametrize("kind", [greedy, sampled])
def test_drafting_steps_overlapped_accept_what_synchronous_ones_accept(pair, kind, launches):
    """Greedy tokens are the target's whatever the drafter does, so equal tokens alone would
    not show a wrong catch-up: the drafter's state carried on the device (its catch-up span
    from the unread step's verdict and features) must give the same drafts, so the same
    acceptance at every position, per request and in all."""
    prompts = random_prompts(6, seed=7, min_len=6, max_len=30)
    params = [kind(n) for n in (30, 9, 22, 30, 14, 26)]
    runs = {}
    for on in (False, True):
        engine = with_static_path(make_engine(pair, k=3, overlap=on))
        outs = engine.generate(prompts, params)
        spec = [(o.usage.num_steps, o.usage.num_accepted) for o in outs]
        runs[on] = ([o.token_ids for o in outs], spec, engine.stats["local"])
        assert_pools_empty(engine)
    assert runs[True] == runs[False]
    assert runs[True][2].num_accepted > 0  # the random pair does accept drafts
    assert sum(1 for event, _ in launches if event == "successor") > 10


def test_the_bundled_pair_accepts_the_same_drafts_overlapped(launches):
    """The same on the trained pair, whose drafter is accepted often: a catch-up span
    carried wrong would show in its acceptance."""
    models = Path(__file__).resolve().parents[4] / "models"
    prompts = ["def fib(n):", "import os\nimport sys\n", "class Queue:\n    def __init__(self"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    runs = {}
    for on in (False, True):
        target, drafter = str(models / "tiny-target"), str(models / "tiny-drafter")
        config = EngineConfig(model=target, drafter=drafter, overlap=on, max_num_seqs=4)
        engine = with_static_path(Engine(config), max_batch=4)
        outs = engine.generate(prompts, params)
        runs[on] = ([o.token_ids for o in outs], [(o.usage.num_steps, o.usage.num_accepted) for o in outs])
        assert_pools_empty(engine)
    assert runs[True] == runs[False]
    steps, accepted = map(sum, zip(*runs[True][1], strict=True))
    assert accepted / steps > 1.0  # AL above 2
    assert sum(1 for event, _ in launches if event == "successor") > 10


@pytest.mark.parametrize("k", [0, 3])
def test_a_read_that_fails_drops_the_successor_and_the_engine_goes_on_exactly(pair, k, launches):
    """A failure while an overlapped step is read (here: moving a request along, after
    another) drops the successor launched from it: the requests not moved along stay at the step
    before, which the next step redoes, so every output is still the synchronous one."""
    prompts = random_prompts(3, seed=9, min_len=6, max_len=20)
    expected = make_engine(pair, k=k).generate(prompts, greedy(16))
    engine = with_static_path(make_engine(pair, k=k, overlap=True))
    advance, calls = engine.progress.advance_decode, []

    def failing(req, step, i):
        calls.append(i)
        if len(calls) == 8:
            raise RuntimeError("injected")
        advance(req, step, i)

    engine.progress.advance_decode = failing
    ids = [engine.add_request(p, greedy(16)) for p in prompts]
    final, failed = {}, 0
    while engine.has_unfinished():
        try:
            final.update({o.request_id: o for o in engine.step() if o.finished})
        except RuntimeError:
            failed += 1
            assert engine.overlapped.in_flight is None
    assert failed == 1 and calls[7] > 0  # an overlapped read with a request moved along before it
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in expected]
    assert_pools_empty(engine)


@pytest.mark.parametrize("k", [0, 3])
def test_pages_a_launched_step_may_write_are_freed_once_it_is_read(pair, k, launches):
    """A request that finishes (or is aborted) while a launched step still has its row keeps
    its pages until that step is read: only then may they go to another request or a
    transfer (written from outside the stream's order). It is no reservation meanwhile."""
    engine = with_static_path(make_engine(pair, k=k, overlap=True))
    short, long_ = random_prompts(2, seed=4, min_len=8, max_len=12)
    a = engine.add_request(short, greedy(5))
    engine.add_request(long_, greedy(40))
    c = engine.add_request(long_[:9], greedy(40))
    seen = {}
    while engine.has_unfinished():
        outs = engine.step()
        if any(o.request_id == a and o.finished for o in outs):
            seen["held"] = engine.manager.has_request(a) and engine.overlapped.holds(a)
            seen["not reserved"] = not engine.holds_reservation(a)
            engine.abort(c)  # between two steps, its row in the step in flight
            seen["abort held"] = engine.manager.has_request(c) and engine.overlapped.holds(c)
        elif "held" in seen and "freed" not in seen:
            seen["freed"] = not engine.manager.has_request(a) and not engine.manager.has_request(c)
    assert seen == {"held": True, "not reserved": True, "abort held": True, "freed": True}
    assert_pools_empty(engine)


def test_a_drafting_run_stops_where_the_adaptive_rule_would_not_draft(pair, launches, monkeypatch):
    """With the adaptive K rule on, a drafting successor is launched only while the rule
    would pick K for it; where it picks no drafts, that step runs (and is measured) as the
    rule says, and greedy outputs are unchanged."""
    prompts = random_prompts(3, seed=2, min_len=8, max_len=16)
    expected = make_engine(pair, k=3).generate(prompts, greedy(30))
    engine = with_static_path(make_engine(pair, k=3, overlap=True))
    engine.adaptive = engine.new_adaptive_k()
    asked = []

    def choose(rule, batch):
        asked.append(batch)
        return 0 if len(asked) in (4, 5, 9, 10) else 3  # asked again by the step that runs

    monkeypatch.setattr(AdaptiveK, "choose", choose)
    outs = engine.generate(prompts, greedy(30))
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert engine.adaptive.costs  # the steps the rule chose were measured
    successors = [e for e in launches if e[0] == "successor"]
    assert len(successors) > 5 and len(launches) - len(successors) > 2  # the run stopped and resumed


@pytest.mark.parametrize("k", [0, 3])
def test_an_overlapping_engine_on_a_cpu_takes_the_static_path_itself(pair, k):
    """``overlap`` on a CPU: the engine builds the graphs' static-buffer path uncaptured
    (what ``--overlap-decode`` gives a CPU worker), its decode steps overlap, and its tokens
    are the eager engine's."""
    prompts = random_prompts(3, seed=8, min_len=4, max_len=12)
    expected = make_engine(pair, k=k).generate(prompts, greedy(10))
    engine = make_engine(pair, k=k, overlap=True)
    assert engine.runner.graphs is not None and engine.adaptive is None
    ids = [engine.add_request(p, greedy(10)) for p in prompts]
    final, kinds = {}, set()
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
        kinds.add(engine.last_step)
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in expected]
    assert "overlapped" in kinds
    assert_pools_empty(engine)


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"enforce_eager": True},
            "overlap: overlapped steps run the graphs' static-buffer path, and enforce_eager",
        ),
        ({"tp_size": 2}, "overlap: overlapped steps run the graphs' static-buffer path, and tp_size 2"),
    ],
)
def test_an_engine_refuses_overlap_where_its_steps_run_eagerly(pair, options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(pair[0]), overlap=True, **options)
