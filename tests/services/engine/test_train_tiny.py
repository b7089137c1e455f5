"""The training script runs end to end on CPU at toy sizes, and its output serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling.params import SamplingParams

REPO = Path(__file__).resolve().parents[3]
TOY = [
    "--device",
    "cpu",
    "--max-files",
    "12",
    "--hidden",
    "32",
    "--layers",
    "2",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--intermediate",
    "64",
    "--context",
    "256",
    "--seq-len",
    "64",
    "--batch",
    "2",
    "--long-seq-len",
    "128",
    "--long-fraction",
    "0.5",
    "--target-steps",
    "3",
    "--window",
    "16",
    "--draft-seq-len",
    "32",
    "--draft-batch",
    "2",
    "--drafter-steps",
    "3",
    "--chain-steps",
    "3",
    "--eval-windows",
    "8",
]


def train(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "models.train_tiny", *args, *TOY],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_train_tiny_runs_a_few_steps_and_the_pair_loads(tmp_path):
    train("--out", str(tmp_path))
    metrics = json.loads((tmp_path / "train_metrics.json").read_text())
    assert metrics["target"]["steps"] == 3 and metrics["drafter"]["steps"] == 3
    # steps 0 and 1 (progress 0, 1/3) on 2 windows of 65, step 2 (2/3) on 1 window of 129
    assert metrics["target"]["tokens"] == 2 * 2 * 65 + 1 * 129
    assert metrics["target"]["held_out_bits_per_byte"] > 0
    assert list(metrics["target"]["held_out_bits_per_byte_by_position"]) == ["0-128"]
    assert len(metrics["drafter"]["held_out_top1_per_step"]) == 3
    assert json.loads((tmp_path / "tiny-target" / "config.json").read_text())["rope_theta"] == 500000.0
    train("--out", str(tmp_path), "--target-from", str(tmp_path / "tiny-target"), "--drafter-name", "wide")
    wide = json.loads((tmp_path / "wide" / "config.json").read_text())
    assert wide["sliding_window"] == 16 and (tmp_path / "train_metrics_wide.json").is_file()
    engine = Engine(
        EngineConfig(
            model=str(tmp_path / "tiny-target"),
            drafter=str(tmp_path / "tiny-drafter"),
            num_spec_tokens=2,
            num_pages=(64, 64),
        )
    )
    out = engine.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.finished and out.usage.prompt_tokens == len(b"def f(x):") + 1
