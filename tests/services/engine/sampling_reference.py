"""Dense, target-only references for the sampling surface tests over the random pair.

Each reference applies the engine's rules (min_tokens, repetition, presence and frequency
penalties, top-k, min-p) over a full forward of the prefix, token by token, with no paged
cache and no drafter: what the engine produces, with or without speculation, must equal it.
"""

from __future__ import annotations

import torch

from services.engine.models import DenseContext
from services.engine.request import Request
from services.engine.sampling.params import SamplingParams
from services.engine.sampling.row_sampling import row_params
from services.engine.sampling.sampler import probs_for_rows

EOS = 31
INF = float("-inf")


def greedy_params(**kwargs) -> SamplingParams:
    """Greedy, 20 tokens and EOS ignored unless the keywords say otherwise."""
    return SamplingParams(temperature=0.0, **{"max_tokens": 20, "ignore_eos": True, **kwargs})


def drain(engine):
    """Every output the engine yields until it has no unfinished request."""
    while engine.has_unfinished():
        yield from engine.step()


@torch.no_grad()
def raw_logits(target, ids: list[int]) -> torch.Tensor:
    out = target(torch.tensor(ids), torch.arange(len(ids)), DenseContext(1, len(ids)))
    return target.head(out.hidden[-1:]).float()[0]  # [vocab]


def reference_greedy(target, prompt: list[int], sp: SamplingParams) -> list[int]:
    """Target-only greedy decoding with the rules written out token by token."""
    out: list[int] = []
    while len(out) < sp.max_tokens:
        logits = raw_logits(target, prompt + out).double()
        if len(out) < sp.min_tokens:
            for t in ([] if sp.ignore_eos else [EOS]) + list(sp.stop_token_ids):
                logits[t] = INF
        for t in set(prompt + out):
            r = sp.repetition_penalty
            logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
        for t in set(out):
            logits[t] -= sp.frequency_penalty * out.count(t) + sp.presence_penalty
        out.append(int(logits.argmax()))
        if len(out) > sp.min_tokens and (
            (out[-1] == EOS and not sp.ignore_eos) or out[-1] in sp.stop_token_ids
        ):
            break
    return out


def transformed_probs_after(
    target, prompt: list[int], sp: SamplingParams, outputs: list[list[int]]
) -> torch.Tensor:
    """[len(outputs), vocab]: the next-token distribution after prompt + each output, with
    every transform of sp applied over that output (all outputs of one length)."""
    reqs = []
    for out in outputs:
        reqs.append(Request("x", prompt, sp, None))
        reqs[-1].output_ids = out
    ids = torch.tensor([prompt + out for out in outputs])
    b, t = ids.shape
    with torch.no_grad():
        hidden = target(ids.reshape(-1), torch.arange(t).repeat(b), DenseContext(b, t)).hidden
        logits = target.head(hidden.view(b, t, -1)[:, -1]).float()
    return probs_for_rows(logits, row_params(reqs, [[[]]] * b, logits.shape[-1], frozenset([EOS]), "cpu"))
