"""Served-load sweep: ``python -m bench.serve sweep [flags]`` (flags: ``bench.serve_args``).

For each configuration (aggregated or 1 prefill + 1 decode worker on one device; with the
EAGLE-3 drafter, forced acceptance on the GPU, or ``--drafter none``) it starts a
``deploy.local.LocalCluster`` on 127.0.0.1 (UCX on ``lo``), sends ``--warmup`` unmeasured
requests per ISL/OSL, then per ISL/OSL a closed-loop point per concurrency C and an
open-loop point per Poisson rate, from streaming gRPC clients (``bench.serve_client``:
token-id prompts, greedy, ``ignore_eos``). Each point's requests are summarized by
``bench.serve_stats``; before any cluster starts, the engine's own decode ceiling at each C
is measured in a subprocess (``bench.serve_ceiling``). Writes ``OUT/sweep.json`` (after every
point, so a cut-short run keeps what it measured), ``OUT/sweep.md`` (the tables it prints)
and ``OUT/sweep.svg``. A configuration whose cluster does not start is recorded under
``failures`` and the sweep goes on.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench import serve_steps, serve_svg
from bench.serve_args import Config, configs, flag_of, parse, text_flag_of, worker_roles
from bench.serve_ceiling_spec import CeilingSpec, run_ceiling
from bench.serve_client import Load, run_load, split
from bench.serve_report import number, point, tables, write_json
from bench.serve_stats import RequestRecord, Slo, summarize
from bench.serve_workload import (
    Lengths,
    closed_requests,
    open_requests,
    point_seed,
    poisson_arrivals,
    prompts,
)
from deploy.local import LocalCluster

START_DELAY_S = 0.3  # from building a point's load to its first send: every client process is ready
FORCED_NOTE = (
    "forced AL N + 1: the workers run with --unsafe-forced-acceptance N, the verifier keeping "
    "exactly N drafts per step whatever the models say (random weights accept nothing): the speed "
    "of that AL, not lossless output."
)


def worker_flags() -> set[str]:
    """The flags ``tandem worker --help`` lists."""
    text = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "worker", "--help"], capture_output=True, text=True, check=True
    ).stdout
    return {t.strip("[],") for t in text.split() if t.startswith(("-", "[-"))}


def check_flags(argvs: list[list[str]]) -> None:
    """SystemExit naming every flag of ``argvs`` that ``tandem worker`` does not take."""
    missing = sorted({t.split("=")[0] for argv in argvs for t in argv if t.startswith("-")} - worker_flags())
    if missing:
        raise SystemExit(f"bench.serve sweep: tandem worker does not take {', '.join(missing)} (yet)")


def ceilings(a: argparse.Namespace, spec: bool) -> tuple[dict, str]:
    """The ceiling rows of the spec (or target-only) engine, keyed (isl, osl, C)."""
    common, _ = worker_roles(Config("agg", spec, a.k, a.forced_accept), a)
    ceiling = CeilingSpec(
        model=a.model,
        drafter=a.drafter if spec else "",
        k=a.k if spec else 0,
        forced=a.forced_accept if spec else 0,
        device=a.device,
        max_num_seqs=flag_of(common, "--max-num-seqs", 64),
        kv_mb=a.ceiling_kv_mb,
        seed=a.seed,
        repeats=a.ceiling_repeats,
        quantization=text_flag_of(common, "--quantization", ""),
    )
    return run_ceiling(ceiling, a.grid, a.concurrency)


class Sweep:
    """The sweep's state: its flags, the clients' process pool (None: in this process), the
    ceilings per spec on/off, and the JSON payload that grows a point at a time."""

    def __init__(self, a: argparse.Namespace, argv: list[str]) -> None:
        self.a = a
        self.vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
        self.pool = None
        self.ceilings: dict[bool, dict] = {}
        self.payload = {
            "date": time.strftime("%Y-%m-%d"), "device": a.device, "model": a.model, "drafter": a.drafter,
            "argv": argv, "configs": [], "points": [], "failures": [], "ceiling_errors": {},
        }  # fmt: skip

    def run(self, chosen: list[Config]) -> None:
        a = self.a
        self.payload["configs"] = [{"name": c.name, "label": c.label} for c in chosen]
        per_config = len(a.grid) * (len(a.concurrency) + len(a.rates))
        print(f"sweep: {len(chosen)} configurations x {per_config} points -> {a.out}", flush=True)
        for spec in dict.fromkeys(c.spec for c in chosen) if a.ceiling == "on" else ():
            print(
                f"the engine's ceiling, {'spec' if spec else 'target-only'} (bench.serve_ceiling)", flush=True
            )
            self.ceilings[spec], error = ceilings(a, spec)
            if error:
                name = "spec" if spec else "target-only"
                self.payload["ceiling_errors"][name] = error
                print(f"the engine's ceiling ({name}) failed: {last_line(error)}", file=sys.stderr)
        if a.client_procs > 1:
            self.pool = multiprocessing.get_context("spawn").Pool(a.client_procs)
        try:
            for config in chosen:
                try:
                    self.serve(config)
                except RuntimeError as e:  # the cluster did not start, or died
                    self.payload["failures"].append({"config": config.name, "error": str(e)[-2000:]})
                    print(f"{config.name}: {e}", file=sys.stderr, flush=True)
        finally:
            if self.pool is not None:
                self.pool.close()
                self.pool.join()

    def send(self, loads: list[Load]) -> list[RequestRecord]:
        if self.pool is None:
            return [r for load in loads for r in run_load(load)]
        return [r for records in self.pool.map(run_load, loads) for r in records]

    def serve(self, config: Config) -> None:
        """Start the cluster, warm it, measure every point, stop it."""
        a = self.a
        common, roles = worker_roles(config, a)
        router = ["--model", a.model, "-k", str(config.k if config.spec else 0), *shlex.split(a.router_args)]
        cluster = LocalCluster(common, router, roles, http_port=-1, start_timeout_s=a.start_timeout_s)
        cluster.start()
        try:
            for lengths in a.grid:
                warm = prompts(a.warmup, lengths.isl, self.vocab, a.seed + 999)
                if warm:
                    self.send([self.load_of(cluster.router_address, warm, lengths.osl, concurrency=1)])
                kinds = [("closed", c) for c in a.concurrency] + [("poisson", r) for r in a.rates]
                for kind in kinds:
                    load = self.load(cluster.router_address, lengths, kind)
                    self.point(config, lengths, kind, load, cluster)
        finally:
            cluster.stop()

    def load(self, address: str, lengths: Lengths, kind: tuple[str, float]) -> Load:
        """A point's load: ``kind`` ("closed", C) or ("poisson", rate in requests/s)."""
        a, (mode, value) = self.a, kind
        seed = point_seed(a.seed, lengths, f"{mode}{value}")
        if mode == "closed":
            count = closed_requests(int(value), a.rounds, a.min_requests)
            ids = prompts(count, lengths.isl, self.vocab, seed)
            return self.load_of(address, ids, lengths.osl, concurrency=int(value))
        count = open_requests(value, a.poisson_seconds, a.min_requests)
        ids = prompts(count, lengths.isl, self.vocab, seed)
        arrivals = tuple(poisson_arrivals(value, count, seed))
        return self.load_of(address, ids, lengths.osl, arrivals=arrivals)

    def load_of(self, address: str, ids: list[list[int]], osl: int, **pace) -> Load:
        """A Load of the sweep's request kind (its timeout and constraint); ``pace``:
        ``concurrency`` or ``arrivals``."""
        a = self.a
        return Load(
            address, ids, osl, timeout_s=a.request_timeout_s, structured_regex=a.structured_regex, **pace
        )

    def point(
        self, config: Config, lengths: Lengths, kind: tuple[str, float], load: Load, cluster: LocalCluster
    ) -> None:
        """Send ``load`` (the point ``kind`` at ``lengths``), summarize it into the payload
        with the workers' engine steps over it (bench/serve_steps.py), rewrite sweep.json,
        print a line."""
        workers = {p.name: p.metrics for p in cluster.processes[cluster.num_routers :]}
        routers = {p.name: p.metrics for p in cluster.processes[: cluster.num_routers]}
        before, routers_before = serve_steps.scrape(workers), serve_steps.scrape(routers)
        start = time.monotonic()
        records = self.send(split(replace(load, start=time.monotonic() + START_DELAY_S), self.a.client_procs))
        wall_s = time.monotonic() - start
        after, routers_after = serve_steps.scrape(workers), serve_steps.scrape(routers)
        steps, cpu = serve_steps.step_means(before, after), serve_steps.thread_cpu_per_step(before, after)
        loops = serve_steps.loop_share(routers_before, routers_after, wall_s)
        stats = summarize(records, Slo(self.a.slo_ttft_ms, self.a.slo_tpot_ms), config.gpus)
        (mode, value), (isl, osl) = kind, (lengths.isl, lengths.osl)
        base = {
            "config": config.name, "label": config.label, "layout": config.layout, "spec": config.spec,
            "forced_al": config.forced + 1 if config.spec and config.forced else 0, "isl": isl, "osl": osl,
            "mode": mode, "concurrency": int(value) if mode == "closed" else 0,
            "rate": float(value) if mode == "poisson" else 0.0,
        }  # fmt: skip
        ceiling = self.ceilings.get(config.spec, {}).get((isl, osl, value)) if mode == "closed" else None
        self.payload["points"].append(
            {
                **point(base, stats, ceiling),
                "engine_steps": steps,
                "thread_cpu_ms_per_step": cpu,
                "router_loop_share": loops,
            }
        )
        write_json(Path(self.a.out) / "sweep.json", self.payload)
        print(progress(self.payload["points"][-1]), flush=True)
        print(f"  engine steps: {serve_steps.describe(steps, cpu, loops)}", flush=True)


def progress(p: dict) -> str:
    load = f"C={p['concurrency']}" if p["mode"] == "closed" else f"{p['rate']:.2f} req/s"
    return (
        f"{p['config']} {p['isl']}/{p['osl']} {load}: {number(p['output_tok_s_per_gpu'])} tok/s, "
        f"TTFT p50 {number(p['ttft_ms']['p50'])} ms, TPOT p50 {number(p['tpot_ms']['p50'])} ms, "
        f"{p['errors']}/{p['requests']} errors"
    )


def report(payload: dict, a: argparse.Namespace) -> str:
    """Write sweep.json, sweep.md and sweep.svg; returns the markdown."""
    out = Path(a.out)
    write_json(out / "sweep.json", payload)
    title = f"Tandem served load, {Path(a.model).name}, {a.device}, {payload['date']}"
    note = f"\n{FORCED_NOTE}\n" if any(p["forced_al"] for p in payload["points"]) else ""
    if a.structured_regex:
        note += f"\nEvery request's output constrained to the regular expression `{a.structured_regex}`.\n"
    note += flags_note(a)
    text = f"{title}\n{note}" + tables(payload["points"], (a.slo_ttft_ms, a.slo_tpot_ms))
    failed = {**payload["ceiling_errors"], **{f["config"]: f["error"] for f in payload["failures"]}}
    for name, error in failed.items():
        text += f"\n{name} failed: {last_line(error)}\n"
    (out / "sweep.md").write_text(text)
    serve_svg.write(str(out / "sweep.svg"), payload["points"], title)
    return text


def flags_note(a: argparse.Namespace) -> str:
    """The router's and the workers' own flags the sweep was given (they change what a row
    measures, e.g. ``--stream-interval``), one line; "" when none."""
    given = [
        f"{who} `{flags}`"
        for who, flags in (
            ("router", a.router_args),
            ("every worker", a.worker_args),
            ("aggregated", a.aggregated_args),
            ("prefill", a.prefill_args),
            ("decode", a.decode_args),
        )
        if flags.strip()
    ]
    return f"\nFlags: {'; '.join(given)}.\n" if given else ""


def last_line(error: str) -> str:
    """A failure's last line (a traceback's exception), '?' for none."""
    return error.strip().splitlines()[-1] if error.strip() else "?"


def main(argv: list[str] | None = None) -> dict:
    """Run the sweep; returns the JSON payload it wrote."""
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    chosen = configs(a)
    check_flags([args for c in chosen for args in _argvs(c, a)])
    sweep = Sweep(a, argv)
    sweep.run(chosen)
    print(report(sweep.payload, a))
    return sweep.payload


def _argvs(config: Config, a: argparse.Namespace) -> list[list[str]]:
    common, roles = worker_roles(config, a)
    return [common] + [extra for _, extra in roles]
