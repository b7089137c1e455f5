"""RequestRows.table_row: the int32 copy of a row kept in step by the two ways a running
request's row changes (grown at its end; its leading NULL run grown by a window's release),
read after every change or after several, equal to converting the whole row."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvcore.request_rows import RequestRows, padded_table
from kvcore.spec import NULL_PAGE


def _changes(seed: int, steps: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(rng.choice(["grow", "grow", "release", "read"]), rng.randint(1, 40)) for _ in range(steps)]


@pytest.mark.parametrize("seed", range(6))
def test_the_copy_equals_the_row_through_growth_and_release(seed):
    rng = random.Random(seed)
    head = [NULL_PAGE] * rng.randint(0, 3)  # a transfer's stale entries at the start
    rows = RequestRows.new({"g": head + list(range(100, 100 + rng.randint(0, 5)))}, 0, None, {})
    row, next_page = rows.rows["g"], 1000
    for kind, n in _changes(seed, 200):
        if kind == "grow":  # extend: new pages at the end
            row.extend(range(next_page, next_page + n))
            next_page += n
        elif kind == "release":  # release_stale: the NULL run grows, first_held moves on
            end = min(len(row), rows.first_held["g"] + n)
            row[rows.first_held["g"] : end] = [NULL_PAGE] * (end - rows.first_held["g"])
            rows.first_held["g"] = end
        else:
            assert rows.table_row("g").tolist() == row
    assert rows.table_row("g").tolist() == row and rows.table_row("g").dtype == np.int32


def test_a_batch_table_pads_copies_and_lists_alike():
    a = RequestRows.new({"g": [NULL_PAGE, 7, 8]}, 0, None, {})
    b = RequestRows.new({"g": [3]}, 0, None, {})
    table = padded_table([a.table_row("g"), b.table_row("g")], "cpu")
    assert table.tolist() == [[NULL_PAGE, 7, 8], [3, NULL_PAGE, NULL_PAGE]]
    assert table.tolist() == padded_table([a.rows["g"], b.rows["g"]], "cpu").tolist()
