"""The router's own request checks: max_tokens filled in to fit, refusals naming the field."""

from __future__ import annotations

import pytest

from proto.tandem.v1 import client_pb2 as cpb
from services.router.api import ModelLimits
from services.router.validation import RequestError, validate_generate

LIMITS = ModelLimits(max_model_len=64, default_max_tokens=8)


def _request(prompt_len: int, **sampling) -> cpb.GenerateRequest:
    return cpb.GenerateRequest(
        token_ids=cpb.TokenIds(ids=[1] * prompt_len), sampling=cpb.SamplingParams(**sampling)
    )


def test_an_unset_max_tokens_becomes_the_default_where_it_fits():
    request = _request(10)
    validate_generate(request, LIMITS, None)
    assert request.sampling.max_tokens == 8


def test_by_default_an_unset_max_tokens_is_the_room_left_in_the_context_as_vllm():
    request = _request(10)
    validate_generate(request, ModelLimits(max_model_len=64), None)
    assert request.sampling.max_tokens == 54


def test_an_unset_max_tokens_is_clamped_to_the_room_left_in_the_context():
    request = _request(61)
    validate_generate(request, LIMITS, None)
    assert request.sampling.max_tokens == 3


def test_an_explicit_max_tokens_is_kept_when_it_fits_and_refused_when_it_does_not():
    request = _request(10, max_tokens=54)
    validate_generate(request, LIMITS, None)
    assert request.sampling.max_tokens == 54
    with pytest.raises(RequestError) as e:
        validate_generate(_request(10, max_tokens=55), LIMITS, None)
    assert (
        str(e.value) == "sampling.max_tokens: 55 exceeds the 54 tokens left in the 64-token context "
        "after the 10-token prompt"
    )


def test_min_tokens_counts_against_the_clamped_default():
    with pytest.raises(RequestError, match=r"^sampling\.min_tokens: 4 exceeds max_tokens \(3\)$"):
        validate_generate(_request(61, min_tokens=4), LIMITS, None)


KV_LIMITS = ModelLimits(max_model_len=64, max_request_tokens=40)


def test_a_request_over_what_the_kv_cache_holds_is_refused_naming_both_numbers():
    with pytest.raises(RequestError) as e:
        validate_generate(_request(10, max_tokens=31), KV_LIMITS, None)
    assert str(e.value) == (
        "sampling.max_tokens: 10 prompt tokens + 31 = 41 exceed the 40 tokens the workers' "
        "KV cache holds for one request"
    )
    with pytest.raises(RequestError, match=r"^prompt: 40 tokens leave no room in the 40 tokens"):
        validate_generate(_request(40), KV_LIMITS, None)


def test_an_unset_max_tokens_is_clamped_to_what_the_kv_cache_holds():
    request = _request(10)
    validate_generate(request, KV_LIMITS, None)
    assert request.sampling.max_tokens == 30
    validate_generate(_request(10, max_tokens=30), KV_LIMITS, None)
