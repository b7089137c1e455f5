"""Where a decode step's time goes on the GPU, from ``torch.profiler`` (no nsys):

    python -m bench.step_timeline [--shape tiny|8b] [--k 4] [--al 4] [--batch 1]
                                  [--draft-quantization none,fp8] [--steps 8] [--json FILE]

For the target alone (K 0) and each drafter setting, ``--steps`` steady decode steps are
profiled with CUDA activity; per step it prints the wall time, the GPU's busy time (the
union of its kernels, copies and sets), and its idle time split by what the host was
doing meanwhile (the innermost of the engine functions this tool marks, or "other"), then
the GPU time of each launching phase and the costliest kernels (over all and under each
launcher). Kernels replayed from a CUDA graph count under the function that launched the
replay. A second pass of as many steps, without the profiler, gives each marked
function's own host time per step (``Tensor.tolist``'s is the wait for the GPU).

``--shape tiny``: the bundled pair at natural AL; ``8b``: the random Llama-3.1-8B-shaped
target and EAGLE-3-shaped drafter of ``bench.spec_shapes`` at forced AL ``--al``.
The profiler slows the host about 3x: read host time from the second pass, GPU time from
the first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import services.engine.engine as engine_module  # noqa: E402
from bench.al_ladder import held_out_corpora, windows  # noqa: E402
from bench.decode_run import decode_run, synchronize  # noqa: E402
from bench.spec_shapes import make_engine as engine_8b  # noqa: E402
from bench.spec_shapes import random_models, random_prompts  # noqa: E402
from bench.spec_speedup import make_engine as tiny_engine  # noqa: E402
from services.engine.device.chain_catch_up import ChainCatchUp  # noqa: E402
from services.engine.device.chain_verify import ChainVerify  # noqa: E402
from services.engine.device.cuda_graphs import DecodeGraphs  # noqa: E402
from services.engine.device.draft_chain import GraphedDraftChain  # noqa: E402
from services.engine.device.graphed_forward import GraphedForward  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.engine.progress import RequestProgress  # noqa: E402
from services.engine.request import Status  # noqa: E402
from services.engine.sampling.params import SamplingParams  # noqa: E402
from services.engine.scheduler import Scheduler  # noqa: E402

MARKED = (  # (owner, attribute): the host functions a gap or a launch is charged to
    (Engine, "step"),
    (Scheduler, "schedule"),
    (engine_module, "device_step_fits"),
    (engine_module, "device_step"),
    (Engine, "_general_decode"),
    (GraphedDraftChain, "run"),
    (GraphedDraftChain, "_load"),
    (ChainCatchUp, "load"),
    (ChainVerify, "load"),
    (DecodeGraphs, "verified"),
    (DecodeGraphs, "run_verify"),
    (DecodeGraphs, "_batch"),
    (GraphedForward, "load"),
    (GraphedForward, "replay"),
    (RequestProgress, "advance_decode"),
    (torch.Tensor, "tolist"),  # the step's one read: waits for the device
)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class Timeline:
    """Per step, ms: wall, GPU busy, GPU idle by the host function running meanwhile, GPU
    time by launching function, the costliest kernels by name (over all, and under each
    launcher); then, from a pass without the profiler, each marked function's own host
    time."""

    steps: int
    wall_ms: float
    busy_ms: float
    idle_ms: dict[str, float]
    launched_ms: dict[str, float]
    kernels_ms: dict[str, float]
    launcher_kernels_ms: dict[str, dict[str, float]]
    host_ms: dict[str, float] | None = None  # own host time per marked function, no profiler
    host_wall_ms: float = 0.0  # ms per step in that pass


@contextlib.contextmanager
def marks(wrap) -> Iterator[None]:
    """Every function of ``MARKED`` replaced by ``wrap(label, fn)`` meanwhile."""
    saved = [(owner, attr, owner.__dict__.get(attr)) for owner, attr in MARKED]
    for owner, attr, _ in saved:
        setattr(owner, attr, wrap(f"{owner.__name__.rsplit('.', 1)[-1]}.{attr}", getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            if fn is None:
                delattr(owner, attr)  # inherited (Tensor.tolist)
            else:
                setattr(owner, attr, fn)


def recorded(label: str, fn):
    """``fn`` inside a ``record_function`` of ``label``."""

    def call(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return call


class HostClock:
    """Own host seconds of each marked function (its time less its marked callees'),
    by ``perf_counter``: no profiler, so nothing but the clock reads slows the host."""

    def __init__(self) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self.stack: list[float] = []  # callees' seconds so far, per open call

    def wrap(self, label: str, fn):
        def call(*args, **kwargs):
            self.stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                self.own[label] += took - self.stack.pop()
                if self.stack:
                    self.stack[-1] += took

        return call


def host_split(engine: Engine, prompts: list[list[int]], max_tokens: int, steps: int) -> dict[str, float]:
    """ms per step of each marked function's own host time over ``steps`` decode steps,
    without the profiler (``Tensor.tolist``'s holds the wait for the device)."""
    clock = HostClock()
    run_steps(engine, prompts, max_tokens, steps, lambda: marks(clock.wrap))
    return {k: round(1e3 * v / steps, 3) for k, v in sorted(clock.own.items(), key=lambda kv: -kv[1])}


def run_steps(engine: Engine, prompts: list[list[int]], max_tokens: int, steps: int, around) -> None:
    """``steps`` decode steps in which every request decodes, inside ``around()`` (a
    context); the batch runs to its end outside it."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while not all(r.status is Status.DECODE for r in engine.requests.values()):
        engine.step()
    for _ in range(2):  # past the first decode step's one-off work
        engine.step()
    with around():
        for _ in range(steps):
            engine.step()
        synchronize(engine.runner.device.type)
    while engine.has_unfinished():
        engine.step()


def profile_steps(engine: Engine, prompts: list[list[int]], max_tokens: int, steps: int) -> dict:
    """The chrome trace (parsed) of :func:`run_steps`' ``steps`` under the profiler."""
    cuda = engine.runner.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU, *[torch.profiler.ProfilerActivity.CUDA] * cuda]
    prof = torch.profiler.profile(activities=activities)

    @contextlib.contextmanager
    def around() -> Iterator[None]:
        with marks(recorded), prof:
            yield

    run_steps(engine, prompts, max_tokens, steps, around)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)


def timeline(trace: dict, top: int = 12) -> Timeline:
    """The split of a trace of whole ``Engine.step`` calls (see the module's docstring)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    marks_ = sorted(
        ((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "user_annotation"),
        key=lambda m: (m[0], -m[1]),
    )
    steps = [m for m in marks_ if m[2] == "Engine.step"]
    lo, hi = steps[0][0], steps[-1][1]
    gpu = sorted(
        (e for e in events if e.get("cat") in GPU_CATEGORIES and lo <= e["ts"] < hi), key=lambda e: e["ts"]
    )
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    n = len(steps)
    idle, launched, kernels = defaultdict(float), defaultdict(float), defaultdict(float)
    by_launcher: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    busy, end = 0.0, lo
    for e in gpu:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if start > end:
            for name, us in split_by_mark(marks_, end, start).items():
                idle[name] += us
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
        at = launches.get(e.get("args", {}).get("correlation"))
        launcher = innermost(marks_, at) if at is not None else "other"
        launched[launcher] += e["dur"]
        kernels[e["name"][:70]] += e["dur"]
        by_launcher[launcher][e["name"][:70]] += e["dur"]
    if hi > end:
        for name, us in split_by_mark(marks_, end, hi).items():
            idle[name] += us
    per_step = lambda d: {k: round(v / n / 1e3, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa: E731
    return Timeline(
        n,
        round((hi - lo) / n / 1e3, 3),
        round(busy / n / 1e3, 3),
        per_step(idle),
        per_step(launched),
        dict(list(per_step(kernels).items())[:top]),
        {k: dict(list(per_step(v).items())[:top]) for k, v in by_launcher.items() if sum(v.values()) > 0},
    )


def innermost(marks_: list[tuple[float, float, str]], t: float) -> str:
    """The name of the shortest mark that holds time ``t`` (us), or "other"."""
    holding = [m for m in marks_ if m[0] <= t < m[1]]
    return min(holding, key=lambda m: m[1] - m[0])[2] if holding else "other"


def split_by_mark(marks_: list[tuple[float, float, str]], a: float, b: float) -> dict[str, float]:
    """us of [a, b) under each innermost mark."""
    cuts = sorted({a, b, *(t for m in marks_ for t in m[:2] if a < t < b)})
    split: dict[str, float] = defaultdict(float)
    for x, y in zip(cuts, cuts[1:], strict=False):
        split[innermost(marks_, (x + y) / 2)] += y - x
    return split


def engines(a: argparse.Namespace, folder: str | None) -> Iterator[tuple[str, Engine]]:
    """(label, engine): the target alone, then one per drafter setting."""
    quantizations = ["" if q == "none" else q for q in a.draft_quantization.split(",")]
    for k, q in [(0, ""), *((a.k, q) for q in quantizations)]:
        label = f"K{k} {q or 'bf16'}" if k else "target-only"
        if folder is None:
            yield label, tiny_engine(k, a.batch, "cuda", draft_quantization=q)
        else:
            engine = engine_8b(folder, k, a.batch, 8 << 30, q)
            if k:
                engine.config.forced_acceptance = a.al - 1
            yield label, engine


def prompts_for(a: argparse.Namespace) -> list[list[int]]:
    if a.shape == "8b":
        return random_prompts(a.batch, a.prompt_len)
    return windows(held_out_corpora()["code"], a.prompt_len, a.batch, seed=0)


def print_timeline(label: str, t: Timeline) -> None:
    idle = sum(t.idle_ms.values())
    print(f"\n{label}: {t.steps} steps, {t.wall_ms:.3f} ms/step, GPU busy {t.busy_ms:.3f}, idle {idle:.3f}")
    splits = [("idle while the host runs", t.idle_ms), ("GPU time by launcher", t.launched_ms),
              ("kernels", t.kernels_ms)]  # fmt: skip
    splits += [(f"kernels launched by {k}", v) for k, v in t.launcher_kernels_ms.items()]
    if t.host_ms is not None:
        splits += [(f"own host time without the profiler ({t.host_wall_ms:.3f} ms/step)", t.host_ms)]
    for title, split in splits:
        print(f"  {title}:")
        for name, ms in split.items():
            if ms >= 0.001:
                print(f"    {ms:8.3f}  {name}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=("tiny", "8b"), default="tiny")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--al", type=int, help="forced acceptance length (8b only; default 4)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--draft-quantization", default="none")
    p.add_argument("--json", help="write the timelines here")
    a = p.parse_args(argv)
    if a.shape == "tiny" and a.al is not None:
        p.error("--al: the tiny pair runs at its natural acceptance; forced AL is for --shape 8b")
    a.al = 4 if a.al is None else a.al
    if not torch.cuda.is_available():
        sys.exit("step_timeline: needs a CUDA device (it profiles GPU kernels)")
    prompts, out = prompts_for(a), {}
    with contextlib.ExitStack() as stack:
        folder = None
        if a.shape == "8b":
            folder = stack.enter_context(random_models())
        for label, engine in engines(a, folder):
            decode_run(engine, prompts, a.max_tokens)  # warm-up: shapes compile here
            out[label] = timeline(profile_steps(engine, prompts, a.max_tokens, a.steps))
            out[label].host_ms = host_split(engine, prompts, a.max_tokens, a.steps)
            out[label].host_wall_ms = round(sum(out[label].host_ms.values()), 3)
            print_timeline(label, out[label])
            del engine
            torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps({k: asdict(v) for k, v in out.items()}, indent=1))


if __name__ == "__main__":
    main()
