"""bench.step_timeline's split of a profiler trace and its host clock, on made-up inputs."""

from __future__ import annotations

import pytest

import bench.step_timeline as st


def annotation(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def gpu(name: str, ts: float, dur: float, correlation: int) -> dict:
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": correlation},
    }


def test_idle_time_goes_to_the_innermost_mark_and_kernels_to_their_launcher():
    """One 100 us step: a replay at 10-30 us launches k1 (35-85) and k2 (88-93); the read
    waits at 40-95. The GPU idles 0-35 (step 0-10, replay 10-30, step 30-35), 85-88 and
    93-95 (the read), 95-100 (step)."""
    trace = {
        "traceEvents": [
            annotation("Engine.step", 0, 100),
            annotation("GraphedForward.replay", 10, 20),
            annotation("Tensor.tolist", 40, 55),
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaGraphLaunch",
                "ts": 20,
                "dur": 5,
                "args": {"correlation": 1},
            },
            gpu("k1", 35, 50, 1),
            gpu("k2", 88, 5, 1),
            gpu("outside the step", 150, 5, 2),
        ]
    }
    t = st.timeline(trace)
    assert (t.steps, t.wall_ms, t.busy_ms) == (1, 0.1, 0.055)
    assert t.idle_ms == {"Engine.step": 0.02, "GraphedForward.replay": 0.02, "Tensor.tolist": 0.005}
    assert t.launched_ms == {"GraphedForward.replay": 0.055}
    assert t.kernels_ms == {"k1": 0.05, "k2": 0.005}
    assert t.launcher_kernels_ms == {"GraphedForward.replay": {"k1": 0.05, "k2": 0.005}}


def test_the_host_clock_charges_a_call_its_time_less_its_marked_callees(monkeypatch):
    ticks = iter([0.0, 1.0, 4.0, 10.0])  # outer starts, inner starts, inner ends, outer ends
    monkeypatch.setattr(st.time, "perf_counter", lambda: next(ticks))
    clock = st.HostClock()
    inner = clock.wrap("inner", lambda: None)
    outer = clock.wrap("outer", lambda: inner())
    outer()
    assert dict(clock.own) == {"inner": 3.0, "outer": 7.0}


def test_forced_acceptance_is_refused_for_the_tiny_pair(capsys):
    with pytest.raises(SystemExit) as exit_:
        st.main(["--shape", "tiny", "--al", "3"])
    assert (
        exit_.value.code == 2
        and "--al: the tiny pair runs at its natural acceptance" in capsys.readouterr().err
    )
