"""top_k, min_p, penalties and min_tokens, each checked exactly on hand-made logits, and the
validation of the sampling fields: every refusal names its field."""

from __future__ import annotations

import pytest
import torch

from services.engine.request import Request
from services.engine.sampling.params import SamplingParams
from services.engine.sampling.row_sampling import row_params
from services.engine.sampling.sampler import Penalties, RowParams, apply_penalties, probs_for_rows
from tests.services.engine.sampling_reference import EOS


def test_penalties_follow_vllm_and_openai():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    pen = Penalties(
        torch.tensor([0]),
        torch.tensor([2.0]),
        torch.tensor([0.5]),
        torch.tensor([0.25]),
        seen=torch.tensor([[True, True, False, False, True]]),
        counts=torch.tensor([[0.0, 3.0, 0.0, 0.0, 1.0]]),
    )
    out = apply_penalties(logits, pen)
    # repetition over seen tokens: 2 / 2, -2 * 2, 0.5 / 2; then output counts:
    # token 1: -4 - 0.25 * 3 - 0.5; token 4: 0.25 - 0.25 - 0.5
    assert out.tolist() == [[1.0, -5.25, 1.0, -1.0, -0.5]]
    assert logits.tolist() == [[2.0, -2.0, 1.0, -1.0, 0.5]]  # not modified


def test_top_k_and_min_p_keep_exactly_their_sets():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 4))
    params = RowParams(
        torch.ones(4),
        torch.ones(4),
        top_k=torch.tensor([2, 0, -1, 0]),
        min_p=torch.tensor([0.0, 0.6, 0.0, 0.3]),
    )
    probs = probs_for_rows(logits, params)
    expected = [
        [0.4 / 0.7, 0.3 / 0.7, 0, 0],
        [0.4 / 0.7, 0.3 / 0.7, 0, 0],
        [0.4, 0.3, 0.2, 0.1],
        [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0],
    ]
    assert torch.allclose(probs, torch.tensor(expected), atol=1e-6)


def test_top_k_one_is_the_argmax_and_greedy_reads_the_penalized_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert probs_for_rows(
        logits, RowParams(torch.ones(1), torch.ones(1), top_k=torch.tensor([1]))
    ).tolist() == [[0, 1, 0]]
    pen = Penalties(
        torch.tensor([0]),
        torch.tensor([4.0]),
        torch.zeros(1),
        torch.zeros(1),
        torch.tensor([[False, True, False]]),
        torch.zeros(1, 3),
    )
    greedy = RowParams(torch.zeros(1), torch.ones(1), penalties=pen)
    assert probs_for_rows(logits, greedy).tolist() == [[0, 0, 1]]  # 3 / 4 < 2


def test_rows_count_the_drafts_before_them_for_penalties_and_min_tokens():
    sp = SamplingParams(
        temperature=0.0, max_tokens=8, presence_penalty=1.0, min_tokens=3, stop_token_ids=(5,)
    )
    req = Request("r", [1, 2], sp, None)
    req.output_ids = [3]
    params = row_params([req], [[[], [4], [4, 4]]], 8, frozenset([EOS % 8]), "cpu")
    assert params.penalties.counts.tolist() == [
        [0, 0, 0, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 2, 0, 0, 0],
    ]
    assert params.penalties.seen[0].nonzero().flatten().tolist() == [1, 2, 3]
    # 1 and 2 tokens so far are < 3: EOS (7) and the stop id banned; 3 so far: free
    assert params.banned.nonzero().tolist() == [[0, 5], [0, 7], [1, 5], [1, 7]]
    ignored = Request("s", [1], SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True), None)
    assert row_params([ignored], [[[]]], 8, frozenset([7]), "cpu").banned is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_bad_new_fields_name_themselves(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(max_tokens=16, **kwargs)
