"""bench.overlap_step over the bundled tiny target, alone and with its drafter, on the CPU
(the uncaptured graph path): both modes decode the same tokens, and the overlapped runs did
launch successors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import overlap_step
from services.engine import overlapped_steps as steps_module

TINY = str(Path(__file__).resolve().parents[2] / "models" / "tiny-target")
DRAFTER = str(Path(__file__).resolve().parents[2] / "models" / "tiny-drafter")


@pytest.mark.parametrize("drafter", ["", DRAFTER])
def test_both_modes_decode_the_same_tokens(capsys, monkeypatch, drafter):
    successors = []
    launch, launch_spec = steps_module.launch, steps_module.launch_spec
    monkeypatch.setattr(steps_module, "launch", lambda *a: successors.append(len(a) > 3) or launch(*a))
    monkeypatch.setattr(
        steps_module, "launch_spec", lambda *a: successors.append(len(a) > 4) or launch_spec(*a)
    )
    argv = ["--model", TINY, "--drafter", drafter, "--device", "cpu", "--batches", "1,3", "--isl", "20"]
    overlap_step.main([*argv, "--osl", "12", "--repeats", "1", "--kv-mb", "16"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["batch"], r["equal"]) for r in rows] == [(1, True), (3, True)]
    assert all(r["ms_per_step_on"] > 0 and r["tok_s_off"] > 0 for r in rows)
    assert any(successors)
