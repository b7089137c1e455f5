"""``python -m bench.serve sweep``'s flags, their per-device defaults and refusals, and the
configurations they name.

Every flag whose default depends on ``--device`` (or that another flag makes meaningless)
defaults to None here and is filled by :func:`parse` from ``DEVICE_DEFAULTS`` or
``COMMON_DEFAULTS``; a flag given where nothing reads it is refused by name.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

from bench.serve_workload import parse_grid, parse_numbers

TINY = ("models/tiny-target", "models/tiny-drafter")
# cuda: both configurations take 0.9 of the one GPU (1P+1D: 0.3 prefill, 0.6 decode), each
# worker's KV cache what its share leaves after weights, activations and graphs
DEVICE_DEFAULTS = {
    "cuda": dict(
        grid="512/128,2048/256,8192/256", concurrency="1,8,32,64,128", rates="1,2,4,8", forced_accept=3,
        worker_args="--max-num-seqs 128 --max-model-len 16384",
        aggregated_args="--gpu-memory-utilization 0.9",
        prefill_args="--gpu-memory-utilization 0.3", decode_args="--gpu-memory-utilization 0.6",
        client_procs=4, ceiling_kv_mb=0, ceiling_repeats=1, start_timeout_s=900.0,
    ),
    "cpu": dict(
        grid="128/32", concurrency="1,4", rates="", forced_accept=0, worker_args="", aggregated_args="",
        prefill_args="", decode_args="", client_procs=1, ceiling_kv_mb=256, ceiling_repeats=3,
        start_timeout_s=180.0,
    ),
}  # fmt: skip
COMMON_DEFAULTS = dict(k=4, poisson_seconds=30.0)
OWNED = ("--model", "--drafter", "-k", "--num-spec-tokens", "--device", "--role", "--router", "--instance-id",
         "--unsafe-forced-acceptance")  # fmt: skip
LAYOUTS = {"agg": "aggregated", "1p1d": "1P+1D"}


@dataclass(frozen=True, slots=True)
class Config:
    """One served configuration. ``layout``: "agg" (one worker, both roles) or "1p1d" (a
    prefill and a decode worker on the same device); ``spec`` False: ``--drafter none``;
    ``forced``: drafts the verifier keeps per step (0 = natural acceptance)."""

    layout: str
    spec: bool
    k: int
    forced: int

    @property
    def name(self) -> str:
        return f"{self.layout}-{'spec' if self.spec else 'nospec'}"

    @property
    def label(self) -> str:
        if not self.spec:
            what = "no drafter"
        elif self.forced:
            what = f"forced AL {self.forced + 1} (K {self.k})"
        else:
            what = f"EAGLE-3 K {self.k} (natural AL)"
        return f"{LAYOUTS[self.layout]}, {what}"

    gpus = 1  # every configuration of this sweep runs on one device


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serve sweep", description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--device", default="cuda", choices=sorted(DEVICE_DEFAULTS), help="where the workers run")
    add(
        "--model", help="target folder (cuda: required, see bench.random_model; cpu: the bundled tiny target)"
    )
    add("--drafter", help="EAGLE-3 folder for the spec configurations (cpu: the bundled tiny drafter)")
    add("--layouts", default="agg,1p1d", help="agg (one worker), 1p1d (prefill + decode, one device)")
    add("--spec", default="on,off", help="on: with the drafter; off: --drafter none")
    add("-k", type=int, help="drafts per step of the spec configurations (default 4)")
    add(
        "--forced-accept",
        type=int,
        choices=(0, 1, 2, 3),
        help="drafts kept per step, AL = N + 1 (worker "
        "flag --unsafe-forced-acceptance N); 0 = natural acceptance (default: cuda 3, cpu 0)",
    )
    add("--grid", help="ISL/OSL pairs (default: cuda 512/128,2048/256,8192/256; cpu 128/32)")
    add("--concurrency", help="closed-loop streams per point (default: cuda 1,8,32,64,128; cpu 1,4)")
    add("--rates", help="Poisson arrival rates, requests/s; '' = none (default: cuda 1,2,4,8; cpu none)")
    add("--rounds", type=int, default=4, help="closed loop: requests per stream")
    add("--min-requests", type=int, default=16, help="requests per point at least")
    add("--poisson-seconds", type=float, help="Poisson: rate x this many requests (default 30)")
    add("--warmup", type=int, default=2, help="unmeasured requests per ISL/OSL per configuration")
    add("--slo-ttft-ms", type=float, default=500.0)
    add("--slo-tpot-ms", type=float, default=25.0)
    add(
        "--worker-args",
        help="more flags for every worker, one string (a lone flag: --worker-args=--flag) "
        "(default: cuda '--max-num-seqs 128 --max-model-len 16384', the grid's longest with room: "
        "a prefill worker on 0.3 of an 80 GB card cannot hold an 8B model's 131072 tokens; cpu none)",
    )
    add(
        "--router-args",
        default="",
        help="more flags for the router, one string (e.g. --router-args=--no-step-streams)",
    )
    add(
        "--aggregated-args",
        help="more flags for the aggregated worker (default: cuda '--gpu-memory-utilization 0.9')",
    )
    add(
        "--prefill-args",
        help="more flags for the prefill worker (default: cuda '--gpu-memory-utilization 0.3')",
    )
    add(
        "--decode-args",
        help="more flags for the decode worker (default: cuda '--gpu-memory-utilization 0.6')",
    )
    add(
        "--structured-regex",
        default="",
        help="constrain every request's output to this regular expression (structured outputs; "
        "it must allow max_tokens tokens, e.g. an unbounded repetition); '' = unconstrained",
    )
    add("--client-procs", type=int, help="client processes sharing each point's streams (cuda 4, cpu 1)")
    add("--ceiling", default="on", choices=("on", "off"), help="the engine's own decode ceiling per batch")
    add(
        "--ceiling-kv-mb",
        type=int,
        help="the ceiling engine's KV memory, MiB; 0 = what 0.9 of the GPU leaves (cuda 0, cpu 256)",
    )
    add("--ceiling-repeats", type=int, help="timed runs per batch, the fastest kept (cuda 1, cpu 3)")
    add("--request-timeout-s", type=float, default=600.0)
    add("--start-timeout-s", type=float, help="cluster start deadline (cuda 900, cpu 180)")
    add("--seed", type=int, default=0)
    add("--out", default="out/serve-sweep", help="folder for sweep.json, sweep.md, sweep.svg")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The flags with every None filled; SystemExit naming a refused flag or value."""
    p = parser()
    a = p.parse_args(argv)
    a.layouts, a.spec = a.layouts.split(","), a.spec.split(",")
    given = {key for key, value in vars(a).items() if value is not None}
    for key, value in {**DEVICE_DEFAULTS[a.device], **COMMON_DEFAULTS}.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    unused = [flag for flag, key, read in _readers(a) if key in given and not read]
    if unused:
        p.error(f"{', '.join(unused)}: not read with the chosen --spec/--layouts/--ceiling/--rates")
    _fill_models(p, a)
    _check(p, a)
    return a


def _readers(a: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """(flag, its key, whether anything reads it) for the flags that others can make moot."""
    spec, layouts = "on" in a.spec, a.layouts
    return [
        ("-k", "k", spec),
        ("--forced-accept", "forced_accept", spec),
        ("--drafter", "drafter", spec),
        ("--aggregated-args", "aggregated_args", "agg" in layouts),
        ("--prefill-args", "prefill_args", "1p1d" in layouts),
        ("--decode-args", "decode_args", "1p1d" in layouts),
        ("--ceiling-kv-mb", "ceiling_kv_mb", a.ceiling == "on"),
        ("--ceiling-repeats", "ceiling_repeats", a.ceiling == "on"),
        ("--poisson-seconds", "poisson_seconds", a.rates.strip() != ""),
    ]


def _fill_models(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.device == "cpu":
        a.model = a.model or TINY[0]
        a.drafter = a.drafter or TINY[1]
    elif a.model is None or ("on" in a.spec and a.drafter is None):
        p.error(
            "--model and --drafter are required with --device cuda: build a random 8B pair with "
            "python -m bench.random_model --out DIR, then --model DIR/target --drafter DIR/drafter"
        )


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    bad = [x for x in a.layouts if x not in LAYOUTS] + [x for x in a.spec if x not in ("on", "off")]
    if bad:
        p.error(f"--layouts/--spec: unknown {bad}; layouts {sorted(LAYOUTS)}, spec on/off")
    if a.k < 1:
        p.error(f"-k: must be >= 1, got {a.k}")
    if "on" in a.spec and a.forced_accept > a.k:
        p.error(f"--forced-accept {a.forced_accept} keeps more drafts than -k {a.k} makes")
    try:
        a.grid, a.concurrency = parse_grid(a.grid), parse_numbers(a.concurrency, "--concurrency")
        a.rates = parse_numbers(a.rates, "--rates", float)
    except ValueError as e:
        p.error(str(e))
    owned = [f for name in ("worker_args", "aggregated_args", "prefill_args", "decode_args")
             for f in shlex.split(getattr(a, name)) if f.split("=")[0] in OWNED]  # fmt: skip
    if owned:
        p.error(
            f"{', '.join(owned)}: set by the sweep itself (--model, --drafter, -k, --forced-accept, --device)"
        )
    if min(a.rounds, a.min_requests, a.client_procs, a.ceiling_repeats) < 1 or a.warmup < 0:
        p.error("--rounds, --min-requests, --client-procs and --ceiling-repeats must be >= 1, --warmup >= 0")


def configs(a: argparse.Namespace) -> list[Config]:
    return [Config(layout, spec == "on", a.k, a.forced_accept) for spec in a.spec for layout in a.layouts]


def worker_roles(config: Config, a: argparse.Namespace) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(every worker's flags, [(role, its own flags)]) of ``config``."""
    common = ["--model", a.model, "--device", a.device]
    if config.spec:
        common += ["--drafter", a.drafter, "-k", str(config.k)]
        common += ["--unsafe-forced-acceptance", str(config.forced)] if config.forced else []
    else:
        common += ["--drafter", "none", "-k", "0"]
    common += shlex.split(a.worker_args)
    if config.layout == "agg":
        return common, [("both", shlex.split(a.aggregated_args))]
    return common, [("prefill", shlex.split(a.prefill_args)), ("decode", shlex.split(a.decode_args))]


def flag_of(argv: list[str], flag: str, default: int) -> int:
    """The last integer value of ``flag`` in ``argv`` (``--f v`` or ``--f=v``), else ``default``."""
    return int(text_flag_of(argv, flag, str(default)))


def text_flag_of(argv: list[str], flag: str, default: str) -> str:
    """The last value of ``flag`` in ``argv`` (``--f v`` or ``--f=v``), else ``default``."""
    value = default
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value
