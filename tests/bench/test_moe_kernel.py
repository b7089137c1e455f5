"""bench.moe_kernel on the CPU: its options parse, tiny shapes run through the reference,
and the table has one row per (shape, T)."""

from __future__ import annotations

import pytest

from bench import moe_kernel


def test_tiny_shapes_run_and_print_a_table(capsys):
    rows = moe_kernel.main(["--device", "cpu", "--tokens", "1,5"])
    assert [(r["shape"], r["tokens"]) for r in rows] == [
        (name, t) for name in moe_kernel.TINY_SHAPES for t in (1, 5)
    ]
    assert all(
        r["kernel_ms"] > 0 and r["reference_ms"] > 0 and r["gbps"] > 0 and r["tflops"] > 0 for r in rows
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| shape | T | tiles | kernel ms") and len(lines) == 2 + len(rows)


def test_touched_bytes_count_only_the_routed_experts():
    experts, (_, ids, _) = moe_kernel.make_layer(moe_kernel.TINY_SHAPES["tiny-gpt-oss"], 1, "cpu")
    e, k, h, i, _ = moe_kernel.TINY_SHAPES["tiny-gpt-oss"]
    per_expert = 2 * (2 * i * h + h * i + 2 * i + h)  # bf16 w13, w2, b13, b2
    assert moe_kernel.touched_bytes(experts, ids) == k * per_expert


def test_tile_choices_are_checked(capsys):
    with pytest.raises(SystemExit) as exit_:
        moe_kernel.main(["--device", "cpu", "--tiles", "16,32,64,128,4,4"])
    assert (
        exit_.value.code == 2 and "--tiles: the Triton kernel's tiles, CUDA only" in capsys.readouterr().err
    )
    with pytest.raises(ValueError, match="--tiles: '16,32,64' is not six positive integers"):
        moe_kernel.parse_tiles("16,32,64")
    assert moe_kernel.parse_tiles("") == []


def test_an_unknown_shape_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        moe_kernel.main(["--device", "cpu", "--shapes", "qwen3-30b-a3b"])
    assert exit_.value.code == 2 and "--shapes: qwen3-30b-a3b unknown on cpu" in capsys.readouterr().err
