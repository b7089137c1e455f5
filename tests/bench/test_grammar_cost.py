"""bench.grammar_cost runs on the CPU and prints one row per (batch, constraint, K)."""

from __future__ import annotations

import pytest

from bench.grammar_cost import main
from tests.services.engine.test_lossless import TINY


@pytest.mark.skipif(
    not (TINY / "tiny-drafter" / "model.safetensors").is_file(), reason="the bundled tiny pair is not present"
)
def test_the_table_has_every_row(capsys):
    rows = main(["--batch", "1", "--max-tokens", "8", "--repeats", "1", "--k", "2"])
    assert [(r["constraint"], r["k"]) for r in rows] == [
        ("none", 0),
        ("none", 2),
        ("json_schema", 0),
        ("json_schema", 2),
    ]
    assert all(r["tokens"] == 8 for r in rows)
    assert capsys.readouterr().out.count("\n| 1 |") == 4
