"""The engine-step profiler (services/worker/step_profile.py), on the CPU: the variables'
parsing and refusals, a real EngineLoop run that profiles steps 1 and 2 into a Chrome trace
and a summary while its outputs stay those of an unprofiled run, a stop inside the window
(what was profiled is written), a WorkerBase that passes its config's profile to its loop,
and a worker process that refuses a bad TANDEM_PROFILE_STEPS at start."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.sampling.params import SamplingParams
from services.worker.engine_loop import EngineLoop
from services.worker.step_profile import StepProfile, StepProfiler, profile_from_env
from services.worker.worker import WorkerBase
from services.worker.worker_config import WorkerConfig
from tests.services.engine.helpers import make_engine, write_pair

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
LENGTHS = [6, 4]
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("pair"))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ------------------------------------------------------------------ the variables


def test_unset_or_empty_is_no_profile(tmp_path):
    assert profile_from_env({}) is None
    assert profile_from_env({"TANDEM_TORCH_PROFILER_DIR": ""}) is None
    assert profile_from_env({"TANDEM_TORCH_PROFILER_DIR": "", "TANDEM_PROFILE_STEPS": ""}) is None


def test_a_directory_profiles_the_given_steps_or_16_to_24_and_is_created(tmp_path):
    folder = tmp_path / "made" / "here"
    env = {"TANDEM_TORCH_PROFILER_DIR": str(folder), "TANDEM_PROFILE_STEPS": "3:5"}
    assert profile_from_env(env) == StepProfile(str(folder), 3, 5)
    assert folder.is_dir()
    assert profile_from_env({"TANDEM_TORCH_PROFILER_DIR": str(folder)}) == StepProfile(str(folder), 16, 24)
    assert profile_from_env({**env, "TANDEM_PROFILE_STEPS": "0:1000"}) == StepProfile(str(folder), 0, 1000)


@pytest.mark.parametrize("steps", ["5:3", "3:3", "a:b", "3", "-1:2", "1:2:3", " 1:2", "0:1001"])
def test_bad_steps_are_refused_naming_the_variable(tmp_path, steps):
    env = {"TANDEM_TORCH_PROFILER_DIR": str(tmp_path), "TANDEM_PROFILE_STEPS": steps}
    with pytest.raises(ValueError, match=rf"^TANDEM_PROFILE_STEPS: .*{re.escape(repr(steps))}"):
        profile_from_env(env)


def test_steps_without_a_directory_are_refused_not_ignored():
    with pytest.raises(
        ValueError, match="^TANDEM_PROFILE_STEPS: '3:5' given without TANDEM_TORCH_PROFILER_DIR"
    ):
        profile_from_env({"TANDEM_PROFILE_STEPS": "3:5"})


def test_a_directory_that_cannot_be_made_is_refused_naming_the_variable(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="^TANDEM_TORCH_PROFILER_DIR: cannot create"):
        profile_from_env({"TANDEM_TORCH_PROFILER_DIR": str(tmp_path / "file" / "sub")})


# ------------------------------------------------------------------ a real run


async def serve(loop: EngineLoop) -> list[list[int]]:
    """Both greedy requests at once, to completion; each one's tokens."""

    async def one(i: int) -> list[int]:
        submit = lambda: loop.engine.add_request(PROMPTS[i], greedy(LENGTHS[i]), f"r{i}")  # noqa: E731
        async with contextlib.aclosing(loop.outputs(f"r{i}", submit)) as outputs:
            async for out in outputs:
                if out.finished:
                    return out.token_ids
        raise AssertionError("no finished output")

    loop.start()
    tokens = await asyncio.gather(one(0), one(1))
    await loop.stop()
    return tokens


def profiled_run(pair, profile: StepProfile) -> tuple[list[list[int]], list[str], StepProfiler]:
    """The tokens, every step's kind (those that ran forwards), and the profiler."""
    engine = make_engine(pair, k=0)
    profiler = StepProfiler(profile, "prefill-t", engine.device)
    kinds: list[str] = []
    loop = EngineLoop(engine, lambda kind, _: kind and kinds.append(kind), profiler=profiler)
    return asyncio.run(serve(loop)), kinds, profiler


def test_a_run_profiles_steps_1_and_2_and_its_outputs_are_the_unprofiled_ones(pair, tmp_path, caplog):
    expected = make_engine(pair, k=0).generate(PROMPTS, [greedy(n) for n in LENGTHS])
    with caplog.at_level(logging.INFO, logger="services.worker.step_profile"):
        tokens, kinds, profiler = profiled_run(pair, StepProfile(str(tmp_path), 1, 3))
    assert tokens == [out.token_ids for out in expected]
    assert len(kinds) > 3  # the window closed before the run ended
    trace, summary = tmp_path / "prefill-t-steps-1-3.json", tmp_path / "prefill-t-steps-1-3.txt"
    assert sorted(os.listdir(tmp_path)) == [trace.name, summary.name]
    lines = summary.read_text().splitlines()
    steps = [line.rsplit(" ", 2)[0] for line in lines if line.startswith("step ")]
    assert steps == [f"step 1 {kinds[1]}", f"step 2 {kinds[2]}"]
    assert "mean wall ms per kind:" in lines and "Self CPU time total" in summary.read_text()
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"engine step 1", "engine step 2"} <= names and "engine step 0" not in names
    assert "engine step 3" not in names
    assert profiler.written == (str(trace), str(summary))
    records = [r.message for r in caplog.records if r.name == "services.worker.step_profile"]
    assert records == [f"engine steps 1..2 profiled: {trace} and {summary}"]


def test_a_stop_inside_the_window_writes_what_was_profiled(pair, tmp_path):
    _, kinds, _ = profiled_run(pair, StepProfile(str(tmp_path), 2, 1000))
    name = f"prefill-t-steps-2-{len(kinds)}"
    assert sorted(os.listdir(tmp_path)) == [f"{name}.json", f"{name}.txt"]
    listed = [
        line for line in (tmp_path / f"{name}.txt").read_text().splitlines() if line.startswith("step ")
    ]
    assert len(listed) == len(kinds) - 2


def test_a_window_never_reached_writes_nothing(pair, tmp_path):
    profiled_run(pair, StepProfile(str(tmp_path), 900, 1000))
    assert os.listdir(tmp_path) == []


class CountingEngine:
    """Steps that run a forward but every third, which runs nothing."""

    def __init__(self) -> None:
        self.calls = 0
        self.last_step = ""

    def step(self) -> list:
        self.calls += 1
        self.last_step = "" if self.calls % 3 == 0 else "decode"
        return []


def test_steps_that_ran_nothing_are_not_counted(tmp_path):
    profiler = StepProfiler(StepProfile(str(tmp_path), 2, 5), "d", torch.device("cpu"))
    engine = CountingEngine()
    for _ in range(9):
        profiler.run(engine)
    assert profiler.counted == 6 and [s.number for s in profiler.steps] == [2, 3, 4]
    assert profiler.written is not None and profiler.written[1].endswith("d-steps-2-5.txt")


def test_the_step_time_leaves_out_writing_the_files(tmp_path, monkeypatch):
    """The engine loop reports ``step_seconds`` as the step's time: the last profiled step's
    must not carry the files' writing (a trace of many steps takes seconds to export)."""
    written = StepProfiler._write

    def slow_write(self, profiler):
        time.sleep(0.5)
        return written(self, profiler)

    monkeypatch.setattr(StepProfiler, "_write", slow_write)
    profiler = StepProfiler(StepProfile(str(tmp_path), 0, 2), "d", torch.device("cpu"))
    engine = CountingEngine()
    for _ in range(2):
        profiler.run(engine)
    assert profiler.written is not None  # the second run wrote the files, slowly
    assert profiler.step_seconds < 0.25


def test_a_profiler_that_fails_to_start_leaves_the_steps_unprofiled(tmp_path, monkeypatch, caplog):
    def refuse(self) -> None:
        raise RuntimeError("no profiler here")

    profiler = StepProfiler(StepProfile(str(tmp_path), 1, 3), "d", torch.device("cpu"))
    engine = CountingEngine()
    monkeypatch.setattr(torch.profiler.profile, "start", refuse)
    for _ in range(6):
        profiler.run(engine)
    profiler.finish()
    assert engine.calls == 6 and profiler.counted == 4 and not profiler.steps
    assert os.listdir(tmp_path) == []
    errors = [r.message for r in caplog.records if r.levelname == "ERROR"]
    assert errors == ["could not start the engine-step profiler; the steps run unprofiled"]


# ------------------------------------------------------------------ the worker


def test_a_worker_profiles_its_loop_from_its_config(pair, tmp_path):
    engine = EngineConfig(model=str(pair[0]), tokens_per_page=4, num_pages=(64, 64), max_num_seqs=4)
    config = WorkerConfig("both", engine, instance_id="agg-t", step_profile=StepProfile(str(tmp_path), 0, 2))

    async def scenario() -> None:
        worker = WorkerBase(config)
        await worker.start()
        submit = lambda: worker.engine.add_request(PROMPTS[0], greedy(4), "r")  # noqa: E731
        async with contextlib.aclosing(worker.loop.outputs("r", submit)) as outputs:
            async for _ in outputs:
                pass
        await worker.stop()

    asyncio.run(scenario())
    assert sorted(os.listdir(tmp_path)) == ["agg-t-steps-0-2.json", "agg-t-steps-0-2.txt"]


def test_a_worker_process_refuses_bad_steps_at_start(tmp_path):
    env = {**os.environ, "TANDEM_TORCH_PROFILER_DIR": str(tmp_path), "TANDEM_PROFILE_STEPS": "5:3"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "worker",
            "--role",
            "both",
            "--port",
            "0",
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "tandem: TANDEM_PROFILE_STEPS: must be START:STOP with 0 <= START < STOP, got '5:3'"
    )
