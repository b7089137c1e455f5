"""Profiling a worker's engine steps with ``torch.profiler``, switched on by environment
variables (as vLLM's ``VLLM_TORCH_PROFILER_DIR``, at the granularity of engine steps):

- ``TANDEM_TORCH_PROFILER_DIR``: the folder the profiles go to (created if missing); unset
  or empty = no profiling.
- ``TANDEM_PROFILE_STEPS``: ``START:STOP`` (default ``16:24``): the steps profiled, START ..
  STOP-1, numbered from 0 over the steps that ran forwards (``engine.last_step`` non-empty
  after ``engine.step()``). A step that ran nothing (every waiting request blocked) is
  neither counted nor listed.

After step STOP-1 the engine thread stops the profiler and writes, in the folder,
``<instance_id>-steps-<start>-<stop>.json`` (a Chrome trace for Perfetto or
chrome://tracing, each step an ``engine step <i>`` range) and ``...txt`` (each step's kind
and host wall ms, the mean wall ms per kind, then torch's table of ops by self CUDA time,
or self CPU time where CUDA was not profiled), then logs one INFO line naming both. A
worker that stops first writes the steps it profiled (the names then give their range);
none profiled, nothing is written. The profiler slows the host: read the kernels' times
from it, not the wall times.
"""

from __future__ import annotations

import logging
import os
import re
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

DIR_VAR = "TANDEM_TORCH_PROFILER_DIR"
STEPS_VAR = "TANDEM_PROFILE_STEPS"
DEFAULT_STEPS = "16:24"
MAX_STEPS = 1000  # STOP - START at most: a trace of more steps is too big to open
TABLE_ROWS = 40
_STEPS = re.compile(r"([0-9]+):([0-9]+)")


@dataclass(frozen=True, slots=True)
class StepProfile:
    """Profile the engine steps numbered ``start`` .. ``stop`` - 1 (counting from 0 the
    steps that ran forwards) into ``directory``. Invariants (``profile_from_env``):
    0 <= start < stop, stop - start <= MAX_STEPS, and the directory exists."""

    directory: str
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class ProfiledStep:
    number: int
    kind: str  # engine.last_step: decode, prefill, mixed, decode+prefill or overlapped
    wall_ms: float  # engine.step() on the host, under the profiler


def profile_from_env(environ: Mapping[str, str]) -> StepProfile | None:
    """The StepProfile the variables ask for; None when TANDEM_TORCH_PROFILER_DIR is unset
    or empty. Creates the folder. Raises ValueError naming the variable: a bad
    TANDEM_PROFILE_STEPS, or one given without the folder (never accepted and ignored), or
    a folder that cannot be made or written."""
    directory, steps = environ.get(DIR_VAR, ""), environ.get(STEPS_VAR, "")
    if not directory:
        if steps:
            raise ValueError(f"{STEPS_VAR}: {steps!r} given without {DIR_VAR}; set both to profile")
        return None
    start, stop = parse_steps(steps or DEFAULT_STEPS)
    return StepProfile(made_directory(directory), start, stop)


def parse_steps(text: str) -> tuple[int, int]:
    """``START:STOP`` as (start, stop); ValueError naming TANDEM_PROFILE_STEPS."""
    match = _STEPS.fullmatch(text)
    if not match or int(match[1]) >= int(match[2]):
        raise ValueError(f"{STEPS_VAR}: must be START:STOP with 0 <= START < STOP, got {text!r}")
    start, stop = int(match[1]), int(match[2])
    if stop - start > MAX_STEPS:
        raise ValueError(f"{STEPS_VAR}: at most {MAX_STEPS} steps (STOP - START), got {text!r}")
    return start, stop


def made_directory(path: str) -> str:
    """``path`` made if missing, as an absolute path; ValueError naming TANDEM_TORCH_PROFILER_DIR
    when it cannot be made or written."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{DIR_VAR}: cannot create {path!r}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{DIR_VAR}: {path!r} is not writable")
    return path


class StepProfiler:
    """Runs the engine's steps (``run``, in place of ``engine.step()``) and profiles those
    of its StepProfile. Engine thread only: torch.profiler records the thread that starts it."""

    def __init__(self, profile: StepProfile, instance_id: str, device: torch.device) -> None:
        self.profile = profile
        self.instance_id = instance_id
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.counted = 0  # steps that ran forwards so far
        self.steps: list[ProfiledStep] = []  # the profiled ones
        self.written: tuple[str, str] | None = None  # the files (json, txt), once written
        self.started = False  # the profiler was started (or failed to start): never again
        self.step_seconds = 0.0  # the last run's engine.step() alone: no profiler start or files
        self._torch: torch.profiler.profile | None = None  # while profiling
        _init_kineto()

    def run(self, engine: Any) -> list:
        """``engine.step()``'s outputs; its step profiled when its number is in the window.
        The profiler starts before step START and stops, writing its files, after STOP-1;
        ``step_seconds`` is the step's own wall time, without either."""
        number = self.counted
        if number == self.profile.start and not self.started:
            self._start()
        profiling = self._torch is not None
        start = time.perf_counter()
        outputs = self._profiled(engine, number) if profiling else engine.step()
        self.step_seconds = time.perf_counter() - start
        if engine.last_step:
            if profiling:
                self.steps.append(ProfiledStep(number, engine.last_step, self.step_seconds * 1000))
            self.counted += 1
            if self.counted == self.profile.stop:
                self.finish()
        return outputs

    def finish(self) -> None:
        """Stop the profiler and write what it profiled (the engine loop's stop calls it
        too); nothing when no step was profiled. A failure is logged, not raised: the worker
        serves on."""
        profiler, self._torch = self._torch, None
        if profiler is None:
            return
        try:
            profiler.stop()
            if not self.steps:
                return
            self.written = self._write(profiler)
        except Exception:  # a profile is no reason to fail a step or stop serving
            log.exception("could not stop or write the engine-step profile (to %s)", self.profile.directory)
            return
        first, last = self.steps[0].number, self.steps[-1].number
        log.info("engine steps %d..%d profiled: %s and %s", first, last, *self.written)

    def summary(self, profiler: torch.profiler.profile) -> str:
        """The .txt: a line per step, the mean wall ms per kind, then the ops tables: by
        self CUDA time (on a GPU), then by self CPU time."""
        lines = [f"engine steps of {self.instance_id}: number, kind, wall ms on the host (profiled)"]
        lines += [f"step {s.number} {s.kind} {s.wall_ms:.3f} ms" for s in self.steps]
        lines.append("mean wall ms per kind:")
        for kind in dict.fromkeys(s.kind for s in self.steps):
            walls = [s.wall_ms for s in self.steps if s.kind == kind]
            lines.append(f"{kind} {statistics.fmean(walls):.3f} ms over {len(walls)} steps")
        averages = profiler.key_averages()
        if self.cuda:  # the GPU's time first, then the host's: a host-bound step shows in the second
            by_gpu = averages.table(sort_by="self_device_time_total", row_limit=TABLE_ROWS)
            lines += ["", "ops by self CUDA time:", by_gpu]
        by_host = averages.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS)
        lines += ["", "ops by self CPU time:", by_host]
        return "\n".join(lines) + "\n"

    def _start(self) -> None:
        """Start torch.profiler (no shapes, no stacks); one that fails to start is logged and
        not tried again: the steps run unprofiled, the worker serves on."""
        self.started = True
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            profiler = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
            profiler.start()
        except Exception:  # a profile is no reason to fail a step
            log.exception("could not start the engine-step profiler; the steps run unprofiled")
            return
        self._torch = profiler

    def _profiled(self, engine: Any, number: int) -> list:
        """One step in an ``engine step <number>`` range (``run`` lists it if it ran
        forwards; one that ran nothing leaves a range of that number with no forwards)."""
        with torch.profiler.record_function(f"engine step {number}"):
            return engine.step()

    def _write(self, profiler: torch.profiler.profile) -> tuple[str, str]:
        """The .json and .txt, named by the profiled steps' range (the window's unless the
        worker stopped first)."""
        first, stop = self.steps[0].number, self.steps[-1].number + 1
        stem = os.path.join(self.profile.directory, f"{self.instance_id}-steps-{first}-{stop}")
        profiler.export_chrome_trace(f"{stem}.json")
        with open(f"{stem}.txt", "w") as f:
            f.write(self.summary(profiler))
        return f"{stem}.json", f"{stem}.txt"


def _init_kineto() -> None:
    """An empty CPU profile on this thread, the one that imported torch (a worker's main
    thread builds the profiler): kineto initializes at its first profile, and there from
    another thread (the engine's) prints a harmless but alarming "ERROR: External init
    callback must run in same thread as registerClient" line."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        pass
