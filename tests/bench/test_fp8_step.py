"""``bench/fp8_step.py``: its arguments, and a CPU smoke run of the toy printing its table."""

import pytest

from bench.fp8_step import main, parse


def test_arguments_parse_to_sorted_batches():
    a = parse(["--batches", "64,1", "--prefill", "512"])
    assert a.batches == [1, 64] and a.prefill == 512 and a.context == 2048 and not a.small
    with pytest.raises(SystemExit):
        parse(["--batches", "0"])


def test_small_run_prints_both_variants(capsys):
    results = main(["--small", "--batches", "1,2", "--context", "32", "--prefill", "16", "--vocab", "64"])
    out = capsys.readouterr().out
    assert "| decode B1 |" in out and "| decode B2 |" in out and "| prefill 16 |" in out
    assert [r["batch"] for r in results["fp8"]["decode"]] == [1, 2]
