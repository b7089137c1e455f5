"""One batch of requests decoded to completion, timed over its decode-only steps."""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from services.engine.engine import Engine
from services.engine.request import Status
from services.engine.sampling.params import SamplingParams


def decode_run(
    engine: Engine,
    prompts: list[list[int]],
    max_tokens: int,
    spent: dict[str, float] | None = None,
    temperature: float = 0.0,
) -> dict:
    """One batch to completion. Time, steps and tokens count only the steps where every
    request decodes (no prefill chunk in the step); so does ``spent`` (seconds per phase,
    filled by :func:`timed_phases`) when given. ``temperature`` > 0: request i samples with
    seed i."""
    engine.stats.clear()
    params = [
        SamplingParams(
            temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=i if temperature else None
        )
        for i in range(len(prompts))
    ]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    final, seconds, steps, tokens = {}, 0.0, 0, 0
    while engine.has_unfinished():
        decoding = all(r.status is Status.DECODE for r in engine.requests.values())
        before = dict(spent) if spent is not None else None
        start = time.perf_counter()
        outputs = engine.step()
        took = time.perf_counter() - start
        if decoding:
            seconds, steps = seconds + took, steps + 1
            tokens += sum(len(o.new_token_ids) for o in outputs)
        elif spent is not None:
            spent.clear()
            spent.update(before)
        final.update({o.request_id: o for o in outputs if o.finished})
    stats = engine.stats.get("local")
    return {
        "al": stats.acceptance_length if stats else 1.0,
        "seconds": seconds,
        "steps": steps,
        "tok_s": tokens / max(seconds, 1e-9),
        "ms_per_step": 1e3 * seconds / max(steps, 1),
        "token_ids": [final[i].token_ids for i in ids],
    }


PHASES = ("run_drafter", "draft_logits", "draft_chain", "run_target", "target_logits")


def timed_phases(engine: Engine, device: str) -> tuple[dict[str, float], Callable[[], None]]:
    """Wrap the runner's phases with synchronized timers; returns (seconds per phase, undo)."""
    spent: dict[str, float] = defaultdict(float)
    runner = engine.runner

    def timed(name: str, fn):
        def call(*args, **kwargs):
            synchronize(device)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            synchronize(device)
            spent[name] += time.perf_counter() - start
            return out

        return call

    graphs = runner.graphs
    chain = getattr(graphs, "chain", None)
    places = [(runner, n, n) for n in ("run_drafter", "draft_logits", "run_target", "target_logits")]
    if chain is not None:  # the device-resident step's own phases
        places += [(chain, "run", "draft_chain")]
    if hasattr(graphs, "run_verify"):  # the device-resident step's target forward
        places += [(graphs, "run_verify", "run_target")]
    for obj, attr, name in places:
        setattr(obj, attr, timed(name, getattr(obj, attr)))

    def undo() -> None:
        for obj, attr, _ in places:
            delattr(obj, attr)  # back to the class's methods

    return spent, undo


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def print_phases(
    rows: list[dict], label: Callable[[dict], str], note: Callable[[dict], str] = lambda r: ""
) -> None:
    """The phase split of each row's target-only (``base``) and speculative (``spec``)
    runs: ``base_phases_ms`` / ``spec_phases_ms``, labelled by ``label(row)``; ``note(row)``
    is appended to the spec line."""
    print("\nphases, ms per decode step (synchronized pass): " + ", ".join(PHASES) + ", rest")
    for r in rows:
        for who in ("base", "spec"):
            ph = r[f"{who}_phases_ms"]
            split = " / ".join(f"{ph[n]:.2f}" for n in (*PHASES, "rest"))
            print(f"  {label(r)} {who}: {split}" + (note(r) if who == "spec" else ""))


def host_profile(engine: Engine, prompts: list[list[int]], max_tokens: int, top: int, **run) -> str:
    """cProfile of one more :func:`decode_run` (prefill steps included): the ``top``
    functions by own time, as ``pstats`` prints them. A function that waits on the
    device (``tolist``, a synchronize) holds that wait in its own time; ``run``: more
    :func:`decode_run` arguments."""
    profile = cProfile.Profile()
    profile.enable()
    decode_run(engine, prompts, max_tokens, **run)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()
