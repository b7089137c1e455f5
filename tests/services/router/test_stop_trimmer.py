"""Streamed text is cut before the first stop string, however the chunks split it."""

from __future__ import annotations

import pytest

from services.router.stop_trimmer import StopTrimmer


def _stream(stops: list[str], chunks: list[str]) -> list[str]:
    trimmer = StopTrimmer(stops)
    return [trimmer.feed(c) for c in chunks] + [trimmer.flush()]


def test_without_stop_strings_text_passes_through():
    assert _stream([], ["ab", "c"]) == ["ab", "c", ""]


def test_a_stop_string_inside_one_chunk_cuts_there_and_ends_the_text():
    assert _stream(["END"], ["abENDcd", "more"]) == ["ab", "", ""]


def test_a_stop_string_split_across_chunks_is_withheld_then_cut():
    assert _stream(["END"], ["abE", "N", "Dxy"]) == ["ab", "", "", ""]


def test_a_withheld_prefix_that_does_not_complete_is_released():
    assert _stream(["END"], ["abE", "Nx", "y"]) == ["ab", "ENx", "y", ""]


def test_a_withheld_tail_is_flushed_at_the_end():
    assert _stream(["END"], ["abEN"]) == ["ab", "EN"]


def test_the_earliest_of_several_stop_strings_wins():
    assert _stream(["world", "lo"], ["hello world"]) == ["hel", ""]


@pytest.mark.parametrize("split", range(1, 12))
def test_any_split_gives_the_text_before_the_first_match(split):
    text, stops = "def f():\n\n\nreturn", ["\n\n", "():"]
    chunks = [text[i : i + split] for i in range(0, len(text), split)]
    assert "".join(_stream(stops, chunks)) == "def f"
