"""What the engine's ceiling (``bench.serve_ceiling``) is asked for, and running it as a
subprocess: the sweep's own process loads no torch and holds no device memory."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from bench.serve_workload import Lengths


@dataclass(frozen=True, slots=True)
class CeilingSpec:
    """``drafter`` "" = none; ``forced`` drafts kept per step, 0 = natural acceptance."""

    model: str
    drafter: str
    k: int
    forced: int
    device: str
    max_num_seqs: int
    kv_mb: int
    seed: int = 0  # the sweep's: the ceiling at B decodes the first B prompts of the served point C = B
    repeats: int = 1  # timed runs per batch; the fastest is kept (a ceiling: the best the engine did)
    quantization: str = ""  # the workers' --quantization ("" = as loaded)

    def argv(self) -> list[str]:
        return [
            "--model", self.model, "--drafter", self.drafter or "none", "-k", str(self.k),
            "--forced-accept", str(self.forced), "--device", self.device,
            "--max-num-seqs", str(self.max_num_seqs), "--kv-mb", str(self.kv_mb), "--seed", str(self.seed),
            "--repeats", str(self.repeats), "--quantization", self.quantization or "none",
        ]  # fmt: skip


def run_ceiling(spec: CeilingSpec, grid: list[Lengths], batches: list[int]) -> tuple[dict, str]:
    """Run ``python -m bench.serve_ceiling`` for ``spec``; returns ({(isl, osl, batch): row}, "") or ({}, the
    failure's last lines)."""
    command = [sys.executable, "-m", "bench.serve_ceiling", *spec.argv()]
    command += ["--grid", ",".join(g.name for g in grid), "--batches", ",".join(map(str, batches))]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {}, "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    return {(r["isl"], r["osl"], r["batch"]): r for r in rows}, ""
