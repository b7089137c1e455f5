"""Speculative sampling in the engine follows the target's distribution.

Small-vocabulary random pair (32 tokens), K = 2, temperature 2 and top-p 0.95 (flat enough
for about a quarter of the drafts to be accepted): the 2nd and 3rd tokens of many
fixed-seed requests (the first comes from prefill, the next ones from verify steps,
accepted or recovered) are compared by chi-square with the target's exact marginals,
computed by dense forwards over every possible prefix.
"""

from __future__ import annotations

import math

import torch

from services.engine.models import DenseContext, load_target
from services.engine.sampling.params import SamplingParams
from services.engine.sampling.sampler import probs_from_logits
from tests.services.engine.helpers import VOCAB, make_engine

TEMPERATURE, TOP_P, NUM_SAMPLES = 2.0, 0.95, 1500
PROMPT = [3, 17, 8, 25, 1, 12]


def next_token_probs(target, prefixes: list[list[int]]) -> torch.Tensor:
    """[len(prefixes), vocab]: the target's sampling distribution after each prefix."""
    ids = torch.tensor(prefixes)
    b, t = ids.shape
    out = target(ids.reshape(-1), torch.arange(t).repeat(b), DenseContext(b, t))
    logits = target.head(out.hidden.view(b, t, -1)[:, -1]).float()
    return probs_from_logits(logits, torch.full((b,), TEMPERATURE), torch.full((b,), TOP_P))


@torch.no_grad()
def exact_marginals(target) -> tuple[torch.Tensor, torch.Tensor]:
    """Marginal distributions of the 2nd and 3rd generated tokens."""
    p1 = next_token_probs(target, [PROMPT])[0]  # [vocab]
    p2 = next_token_probs(target, [PROMPT + [a] for a in range(VOCAB)])  # [a, vocab]
    p3 = next_token_probs(target, [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    joint12 = p1[:, None] * p2  # [a, b]
    return joint12.sum(0), (joint12.reshape(-1, 1) * p3).sum(0)


def chi_square_passes(counts: torch.Tensor, probs: torch.Tensor, z: float = 3.09) -> bool:
    """Pools cells expecting < 5 samples, then compares with the Wilson-Hilferty
    approximation of the chi-square quantile at p = 0.001 (z = 3.09)."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical


def test_spec_sampling_matches_the_target_marginals(pair):
    second, third = exact_marginals(load_target(pair[0]))
    engine = make_engine(pair, k=2, max_num_seqs=128, num_pages=(1024, 1024), max_num_batched_tokens=1024)
    params = [
        SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=3, seed=s, ignore_eos=True)
        for s in range(NUM_SAMPLES)
    ]
    outputs = engine.generate([PROMPT] * NUM_SAMPLES, params)
    tokens = torch.tensor([o.token_ids for o in outputs])  # [samples, 3]
    assert engine.stats["local"].num_accepted > 0  # both accepted and recovered tokens occur
    assert engine.stats["local"].num_accepted < engine.stats["local"].num_draft_tokens
    assert chi_square_passes(torch.bincount(tokens[:, 1], minlength=VOCAB).float(), second)
    assert chi_square_passes(torch.bincount(tokens[:, 2], minlength=VOCAB).float(), third)
