import json
import xml.etree.ElementTree as ET

from bench.before_after import Metric, Row, main, render

SVG = "{http://www.w3.org/2000/svg}"


def _texts(svg: str) -> list[str]:
    return [t.text for t in ET.fromstring(svg).iter(f"{SVG}text")]


def test_a_pair_of_bars_per_row_and_metric_with_the_ratio():
    metrics = [Metric("tok_s", "output tok/s"), Metric("ttft", "TTFT p50 ms")]
    rows = [
        Row("tiny", {"tok_s": 8000, "ttft": 686}, {"tok_s": 24000, "ttft": 86}),
        Row("8B", {"tok_s": 3398, "ttft": 77}, {"tok_s": 3899, "ttft": 114.7}),
    ]
    svg = render("served speed", metrics, rows)
    bars = [r for r in ET.fromstring(svg).iter(f"{SVG}rect") if r.get("fill") in ("#9a9a9a", "#4878a8")]
    assert len(bars) == 2 + 2 * 2 * 2  # the legend's two, then two per row and metric
    texts = _texts(svg)
    assert {"after 3.00x", "after 0.13x", "after 1.15x", "after 1.49x"} <= set(texts)
    assert "24,000" in texts and "8,000" in texts and texts.count("tiny") == 2


def test_a_missing_value_leaves_its_bar_and_ratio_out():
    svg = render("t", [Metric("tok_s", "tok/s")], [Row("only after", {}, {"tok_s": 5.5})])
    texts = _texts(svg)
    assert "5.50" in texts and not any(t.endswith("x") for t in texts if t)
    bars = [r for r in ET.fromstring(svg).iter(f"{SVG}rect") if r.get("fill") == "#4878a8"]
    assert len(bars) == 2  # the legend's and the one value's


def test_the_command_writes_the_figure(tmp_path):
    figure = {
        "title": "before and after",
        "metrics": [{"key": "tok_s", "name": "tok/s"}],
        "rows": [{"label": "agg", "before": {"tok_s": 100}, "after": {"tok_s": 250}}],
    }
    (tmp_path / "f.json").write_text(json.dumps(figure))
    main([str(tmp_path / "f.json"), str(tmp_path / "f.svg")])
    texts = _texts((tmp_path / "f.svg").read_text())
    assert "before and after" in texts and "after 2.50x" in texts
