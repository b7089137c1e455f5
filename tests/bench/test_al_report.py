"""The AL ladder's report: ratios with their interval, equality, TTFT, bytes, the plot."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from bench.al_report import Record, markdown, ratio_ci, rows, svg


def test_the_ratio_is_the_mean_of_per_prompt_ratios_with_a_t_interval():
    mean, half = ratio_ci([2.0, 3.0], [2.0, 2.0])  # ratios 1.0 and 1.5
    assert mean == 1.25 and half == pytest.approx(12.71 * 0.35355339 / 1.41421356, rel=1e-6)
    assert ratio_ci([3.0], [2.0]) == (1.5, 0.0)


def _run() -> dict:
    same, other = [1, 2, 3], [1, 2, 4]
    return {
        "aggregated": {128: [Record(same, 3.0), Record(same, 3.0)]},
        "unified": {128: [Record(same, 3.0, 0.1, {"target": 2048, "draft": 1024}, 0.02)] * 2},
        "separate": {
            128: [Record(same, 1.5, 0.3, {"target": 2048}), Record(other, 1.5, 0.5, {"target": 4096})]
        },
    }


def test_rows_compare_every_mode_with_aggregated():
    (row,) = rows(_run())
    assert row["al"] == {"aggregated": 3.0, "unified": 3.0, "separate": 1.5}
    assert row["unified_ratio"] == (1.0, 0.0) and row["separate_ratio"] == (0.5, 0.0)
    assert (row["unified_equal"], row["separate_equal"]) == (True, False)
    assert (round(row["unified_ttft_ms"]), round(row["separate_ttft_ms"])) == (100, 400)
    assert row["unified_bytes"] == {"draft": 1024, "target": 2048} and row["separate_bytes"] == {
        "target": 3072
    }
    line = markdown([row]).splitlines()[2]
    assert line.startswith(
        "| 128 | 3.00 | 3.00 | 1.000 ± 0.000 | 1.50 | 0.500 ± 0.000 | NO | 100 / 400 | 20 / 0 |"
    )
    assert line.endswith("| draft 1 KiB, target 2 KiB | target 3 KiB |")


def test_the_plot_is_well_formed_svg_with_a_line_per_mode():
    run = _run()
    for mode in run:
        run[mode][1024] = run[mode][128]
    root = ET.fromstring(svg(rows(run), "AL"))
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 3 and all(len(line.get("points").split()) == 2 for line in lines)
