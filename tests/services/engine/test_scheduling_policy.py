"""The scheduling policies change the forwards' shapes, never a request's tokens: mixed
(decode rows and prompt chunks in one forward), decode-first and prefill-first give the
same outputs token for token, across requests joining, finishing, aborted and preempted
mid-step, greedy and seeded sampling, with and without the drafter; pages back to zero."""

from __future__ import annotations

import pytest

from services.engine.config import EngineConfig
from services.engine.sampling.params import SamplingParams
from tests.services.engine.helpers import assert_pools_empty, make_engine, random_prompts

POLICIES = ("decode-first", "prefill-first", "mixed")


def params_for(count: int) -> list[SamplingParams]:
    """Every third request samples with its own seed; the others are greedy. Lengths vary
    so requests finish at different steps."""
    return [
        SamplingParams(
            temperature=0.8 if i % 3 == 0 else 0.0,
            seed=i if i % 3 == 0 else None,
            max_tokens=8 + 5 * (i % 4),
            ignore_eos=True,
        )
        for i in range(count)
    ]


def churn(engine, prompts, params, abort_at: int = 3) -> dict[str, list[int]]:
    """Requests join two per step while earlier ones decode; request 1 is aborted at step
    ``abort_at``. Returns request id -> token ids of its final output."""
    pending = list(zip(prompts, params, strict=True))
    final: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished():
        for _ in range(2):
            if pending:
                p, sp = pending.pop(0)
                engine.add_request(p, sp, request_id=f"r{len(prompts) - len(pending) - 1}")
        if step == abort_at:
            engine.abort("r1")
        outputs = engine.step()
        for o in outputs:
            if o.finished:
                final[o.request_id] = o.token_ids
        step += 1
    return final


@pytest.mark.parametrize("k", [0, 3])
def test_policies_give_the_same_tokens_across_churn(pair, k):
    prompts = random_prompts(12, seed=35, min_len=10, max_len=40)
    params = params_for(len(prompts))
    results = {}
    for policy in POLICIES:
        engine = make_engine(pair, k=k, scheduling_policy=policy, num_pages=(48, 48))
        mixed_steps = []
        engine._mixed = spy(engine._mixed, mixed_steps)
        results[policy] = churn(engine, prompts, params)
        assert engine.scheduler.num_preemptions > 0, "the page budget should force preemptions"
        assert bool(mixed_steps) == (policy == "mixed")
        assert_pools_empty(engine)
    assert results["mixed"] == results["decode-first"]
    assert results["prefill-first"] == results["decode-first"]
    assert set(results["mixed"]) == {f"r{i}" for i in range(len(prompts))}


def test_mixed_without_pressure_matches_generate_alone(pair):
    """No preemption: each request's tokens equal it run by itself."""
    prompts = random_prompts(6, seed=36, min_len=20, max_len=40)
    params = params_for(len(prompts))
    engine = make_engine(pair, k=3, scheduling_policy="mixed")
    mixed_steps = []
    engine._mixed = spy(engine._mixed, mixed_steps)
    together = churn(engine, prompts, params, abort_at=-1)
    assert mixed_steps
    alone = make_engine(pair, k=3, scheduling_policy="decode-first")
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        assert together[f"r{i}"] == alone.generate([p], sp)[0].token_ids
    assert_pools_empty(engine)


def test_policy_defaults_by_device_and_drafter_and_refuses_unknown(pair):
    target, drafter = str(pair[0]), str(pair[1])
    assert EngineConfig(model=target).scheduling_policy == "decode-first"
    assert EngineConfig(model=target, device="cuda").scheduling_policy == "mixed"
    assert EngineConfig(model=target, drafter=drafter, device="cuda").scheduling_policy == "decode-first"
    alone = EngineConfig(model=target, drafter=drafter, num_spec_tokens=0, device="cuda")
    assert alone.scheduling_policy == "mixed"
    eager = dict(model=target, drafter=drafter, device="cuda")  # no graphed drafting step to keep
    assert EngineConfig(**eager, enforce_eager=True).scheduling_policy == "mixed"
    assert EngineConfig(**eager, tp_size=2).scheduling_policy == "mixed"
    with pytest.raises(ValueError, match="^scheduling_policy:"):
        EngineConfig(model=str(pair[0]), scheduling_policy="fifo")


def spy(fn, calls: list):
    def call(*args):
        calls.append(len(args[0]))
        return fn(*args)

    return call
