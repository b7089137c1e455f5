"""The served-load sweep's pure parts on stated inputs: percentiles, TTFT/TPOT/ITL, goodput,
AL, transfers, the workload, how a point is split over client processes, the table and the
SVG. Times are binary fractions so that the arithmetic is exact."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest

from bench import serve_svg
from bench.serve_client import Load, count_error, split, take
from bench.serve_report import point, tables, write_json
from bench.serve_stats import RequestRecord, Slo, Transfer, meets_slo, percentile, summarize, weighted_al
from bench.serve_workload import (
    Lengths,
    closed_requests,
    open_requests,
    parse_grid,
    parse_numbers,
    poisson_arrivals,
    prompts,
)
from proto.tandem.v1 import client_pb2 as cpb

SLO = Slo(ttft_ms=300.0, tpot_ms=300.0)


def records() -> list[RequestRecord]:
    """Two successes and a failure over a 2 s span (the first send at 0, the last end at 2)."""
    return [
        RequestRecord(
            sent=0.0, prompt_tokens=4, chunk_times=[0.25, 0.5, 1.0], tokens=5, end=1.25,
            acceptance_length=2.0, decode_steps=2,
            transfers=[Transfer("target", 1000, 0.002), Transfer("draft", 100, 0.001)],
        ),
        RequestRecord(
            sent=0.5, prompt_tokens=4, chunk_times=[1.0, 1.5], tokens=3, end=2.0,
            acceptance_length=1.5, decode_steps=4, transfers=[Transfer("target", 3000, 0.004)],
        ),
        RequestRecord(sent=1.0, prompt_tokens=4, end=1.5, error="UNAVAILABLE: gone"),
    ]  # fmt: skip


def test_percentile_interpolates_between_ranks():
    assert percentile([4, 1, 3, 2], 0.5) == 2.5
    assert percentile([1, 2, 3, 4], 0.9) == pytest.approx(3.7)
    assert percentile([1, 2, 3, 4], 0.99) == pytest.approx(3.97)
    assert percentile([5.0], 0.99) == 5.0
    assert math.isnan(percentile([], 0.5))


def test_ttft_tpot_and_gaps_of_one_request():
    r = records()[0]
    assert r.ttft_s == 0.25
    assert r.tpot_s == (1.25 - 0.25) / 4
    assert r.gaps_s == [0.25, 0.5]
    one = RequestRecord(sent=0.0, prompt_tokens=4, chunk_times=[0.5], tokens=1, end=0.75)
    assert math.isnan(one.tpot_s)


def test_goodput_needs_success_and_both_slos_and_a_one_token_request_only_the_ttft():
    ok, slow_ttft, failed = records()
    assert meets_slo(ok, SLO)
    assert not meets_slo(slow_ttft, SLO)  # TTFT 500 ms
    assert not meets_slo(failed, SLO)
    assert not meets_slo(ok, Slo(ttft_ms=300.0, tpot_ms=249.0))  # TPOT 250 ms
    one = RequestRecord(sent=0.0, prompt_tokens=4, chunk_times=[0.25], tokens=1, end=5.0)
    assert meets_slo(one, SLO)


def test_a_point_summary():
    s = summarize(records(), SLO, gpus=2)
    assert (s.requests, s.errors, s.output_tokens) == (3, 1, 8)
    assert s.duration_s == 2.0
    assert (s.output_tok_s, s.output_tok_s_per_gpu, s.requests_per_s) == (4.0, 2.0, 1.0)
    assert (s.ttft_ms.p50, s.ttft_ms.p90, s.ttft_ms.p99) == pytest.approx((375.0, 475.0, 497.5))
    assert (s.tpot_ms.p50, s.tpot_ms.p90, s.tpot_ms.p99) == pytest.approx((375.0, 475.0, 497.5))
    assert s.itl_p99_ms == 500.0  # gaps 250, 500, 500 ms
    assert s.acceptance_length == pytest.approx((2.0 * 2 + 1.5 * 4) / 6)
    assert (s.goodput_req_s, s.slo_attainment) == (0.5, pytest.approx(1 / 3))
    assert sorted(s.transfers) == ["draft", "target"]
    target = s.transfers["target"]
    assert (target.ms_mean, target.ms_p99, target.bytes_mean) == pytest.approx((3.0, 3.98, 2000.0))
    assert s.first_errors == ["UNAVAILABLE: gone"]


def test_al_is_nan_without_decode_steps():
    assert math.isnan(weighted_al([RequestRecord(sent=0.0, prompt_tokens=1)]))


def test_the_workload_is_seeded_and_sized_as_stated():
    assert parse_grid("512/128, 2048/256") == [Lengths(512, 128), Lengths(2048, 256)]
    for bad in ("512", "512/0", "a/b"):
        with pytest.raises(ValueError, match="--grid"):
            parse_grid(bad)
    assert parse_numbers("1,8", "--concurrency") == [1, 8] and parse_numbers("", "--rates", float) == []
    with pytest.raises(ValueError, match="--rates"):
        parse_numbers("1,-2", "--rates", float)
    ids = prompts(3, 7, 10, seed=5)
    assert ids == prompts(3, 7, 10, seed=5) != prompts(3, 7, 10, seed=6)
    assert [len(p) for p in ids] == [7, 7, 7] and all(0 <= t < 10 for p in ids for t in p)
    assert prompts(2, 7, 10, seed=5) == ids[:2]
    arrivals = poisson_arrivals(4.0, 5, seed=1)
    assert arrivals[0] == 0.0 and len(arrivals) == 5 and arrivals == sorted(set(arrivals))
    assert (closed_requests(8, 4, 16), closed_requests(1, 4, 16), open_requests(2.0, 30.0, 16)) == (
        32,
        16,
        60,
    )


def test_a_closed_loop_point_splits_by_stream_and_an_open_one_by_arrival():
    ids = [[i] for i in range(5)]
    closed = split(Load("a", ids, 8, concurrency=3, start=7.0), 2)
    assert [(s.prompts, s.concurrency, s.start) for s in closed] == [
        ([[0], [2], [3]], 2, 7.0),
        ([[1], [4]], 1, 7.0),
    ]
    opened = split(Load("a", ids, 8, arrivals=(0.0, 1.0, 2.0, 3.0, 4.0)), 2)
    assert [(s.prompts, s.arrivals) for s in opened] == [
        ([[0], [2], [4]], (0.0, 2.0, 4.0)),
        ([[1], [3]], (1.0, 3.0)),
    ]
    assert len(split(Load("a", ids[:1], 8, concurrency=1), 4)) == 1


def points() -> list[dict]:
    s = summarize(records(), SLO)
    base = dict(config="agg-spec", label="aggregated, forced AL 4 (K 4)", layout="agg", spec=True,
                forced_al=4, isl=32, osl=8, mode="closed", concurrency=2, rate=0.0)  # fmt: skip
    ceiling = {"tok_s": 8.0, "ceiling_batch": 2, "al": 4.0}
    poisson = dict(base, mode="poisson", concurrency=0, rate=2.0)
    return [point(base, s, ceiling), point(poisson, s, None), point(dict(base, isl=64), s, None)]


def test_the_table_has_a_row_per_point_and_a_table_per_isl_osl(tmp_path):
    text = tables(points(), (500.0, 25.0))
    assert text.count("| configuration |") == 2
    assert "| aggregated, forced AL 4 (K 4) | C=2 | 3 | 1 | 4.0 | 1.00 | 375.0 / 475.0 / 497.5 |" in text
    assert "| 8 (B 2, AL 4.00) | 0.50 |" in text  # ceiling 8 tok/s at B 2; served 4.0 / 8
    assert "| Poisson 2.00 req/s | 3 | 1 |" in text and "| – | – |" in text
    assert "target 3.00 ms 0.00 MB; draft" not in text and "draft 1.00 ms 0.00 MB; target 3.00 ms" in text
    write_json(tmp_path / "p.json", {"points": points()})
    loaded = json.loads((tmp_path / "p.json").read_text())
    assert loaded["points"][1]["ceiling_tok_s"] is None and loaded["points"][0]["served_over_ceiling"] == 0.5


def test_the_svg_is_well_formed_with_a_line_per_configuration_and_mode():
    data = points()
    data.append(dict(data[0], label="no finite", output_tok_s_per_gpu=math.nan))
    root = ET.fromstring(serve_svg.render(data, "a <title> & more"))
    assert root.tag.endswith("svg")
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert len(lines) == 2 * (2 + 1)  # 2 panels x (ISL 32: closed, poisson; ISL 64: closed); no NaN line
    assert serve_svg.log_ticks(15.0, 600.0) == [20, 50, 100, 200, 500]


def test_streamed_messages_fold_into_a_record_and_counts_must_be_exact():
    r = RequestRecord(sent=0.0, prompt_tokens=4)
    take(r, cpb.GenerateResponse(chunk=cpb.Chunk(token_ids=[7])), 0.25)
    take(r, cpb.GenerateResponse(chunk=cpb.Chunk(text="tail")), 0.3)  # no tokens: not a chunk time
    take(r, cpb.GenerateResponse(chunk=cpb.Chunk(token_ids=[8, 9, 10])), 0.5)
    usage = cpb.Usage(prompt_tokens=4, completion_tokens=4, acceptance_length=3.0, num_drafts=1,
                      transfers=[cpb.GroupTransfer(group="target", num_bytes=64, seconds=0.001)])  # fmt: skip
    take(
        r,
        cpb.GenerateResponse(complete=cpb.Complete(finish_reason=cpb.FINISH_REASON_LENGTH, usage=usage)),
        0.75,
    )
    assert (r.chunk_times, r.tokens, r.end, r.error) == ([0.25, 0.5], 4, 0.75, "")
    assert (r.acceptance_length, r.decode_steps, r.transfers) == (3.0, 1, [Transfer("target", 64, 0.001)])
    assert count_error(r, 4) == ""
    assert (
        count_error(r, 5) == "4 tokens streamed, usage 4 completion and 4 prompt tokens; asked for 5 after 4"
    )
    stopped = RequestRecord(sent=0.0, prompt_tokens=4)
    take(stopped, cpb.GenerateResponse(complete=cpb.Complete(finish_reason=cpb.FINISH_REASON_STOP)), 0.5)
    assert stopped.error == "finished FINISH_REASON_STOP"
    failed = RequestRecord(sent=0.0, prompt_tokens=4)
    take(failed, cpb.GenerateResponse(error=cpb.Error(message="boom")), 0.5)
    take(failed, cpb.GenerateResponse(complete=cpb.Complete(finish_reason=cpb.FINISH_REASON_ERROR)), 0.6)
    assert failed.error == "error message: boom"
