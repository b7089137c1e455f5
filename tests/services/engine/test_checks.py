"""services/engine/checks.py: an engine asked for a max_model_len its KV cache cannot hold
refuses to start, naming both lengths; the longest it takes is what check_fits admits."""

from __future__ import annotations

import pytest

from services.engine.checks import check_fits, longest_fitting
from tests.services.engine.helpers import make_engine


def test_a_max_model_len_the_cache_cannot_hold_is_refused_at_start(pair):
    # 256 target pages of 4 tokens, K = 2: one request holds 1024 - 3 tokens of headroom
    assert make_engine(pair, k=2, max_model_len=1021).max_model_len == 1021
    with pytest.raises(ValueError) as e:
        make_engine(pair, k=2, max_model_len=1022)
    assert str(e.value) == (
        "max_model_len: 1022 tokens do not fit the KV cache: it holds one request of at most 1021 "
        "tokens (256 pages of group target, 256 pages of group draft, 3 tokens of headroom); lower "
        "--max-model-len or give the KV cache more memory (--gpu-memory-utilization, --kv-cache-mb)"
    )


def test_the_model_length_unasked_is_not_checked_at_start(pair):
    engine = make_engine(pair, k=2, num_pages=(64, 64))  # 253 tokens; the model's 512 is not asked for
    assert (engine.max_model_len, longest_fitting(engine.manager)) == (512, 253)


def test_the_longest_fitting_request_is_check_fits_boundary(pair):
    # the drafter's window (8) with its spans needs 11 pages at once: 8 bound it to 8 x 4 - 3
    engine = make_engine(pair, k=2, num_pages=(256, 8))
    assert longest_fitting(engine.manager) == 29
    check_fits(10, 19, 512, engine.manager)
    with pytest.raises(ValueError, match="^prompt: needs 9 KV pages of group draft, the cache holds 8"):
        check_fits(10, 20, 512, engine.manager)
    roomy = make_engine(pair, k=2, num_pages=(256, 11))  # holds the window: only the target bounds it
    assert longest_fitting(roomy.manager) == 1021
