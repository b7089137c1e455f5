"""Request's token reads that a step makes for every request: equal to slicing ``tokens``,
which they avoid building (O(prompt + output) each)."""

from __future__ import annotations

import itertools

from services.engine.request import Request
from services.engine.sampling.params import SamplingParams


def test_last_token_and_token_range_equal_slices_of_tokens():
    req = Request("r", [5, 6, 7, 8], SamplingParams(), None)
    assert req.last_token == 8
    for start, end in itertools.combinations_with_replacement(range(5), 2):
        assert req.token_range(start, end) == req.tokens[start:end], (start, end)
    req.output_ids.extend([9, 10, 11])
    assert req.last_token == 11
    for start, end in itertools.combinations_with_replacement(range(9), 2):  # past the end too
        assert req.token_range(start, end) == req.tokens[start:end], (start, end)
