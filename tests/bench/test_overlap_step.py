"""bench.overlap_step over the bundled tiny target on the CPU (the uncaptured graph path):
both modes decode the same tokens, and the overlapped runs did launch successors."""

from __future__ import annotations

import json
from pathlib import Path

from bench import overlap_step
from services.engine import overlapped_steps as steps_module

TINY = str(Path(__file__).resolve().parents[2] / "models" / "tiny-target")


def test_both_modes_decode_the_same_tokens(capsys, monkeypatch):
    successors = []
    launch = steps_module.launch
    monkeypatch.setattr(steps_module, "launch", lambda *a: successors.append(len(a) > 3) or launch(*a))
    argv = ["--model", TINY, "--device", "cpu", "--batches", "1,3", "--isl", "20", "--osl", "12"]
    overlap_step.main([*argv, "--repeats", "1", "--kv-mb", "16"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["batch"], r["equal"]) for r in rows] == [(1, True), (3, True)]
    assert all(r["ms_per_step_on"] > 0 and r["tok_s_off"] > 0 for r in rows)
    assert any(successors)
