"""Logits -> probabilities -> tokens, per row (a row is one request at one position).

The transforms run in vLLM v1's order: stop tokens banned by ``min_tokens``, penalties on
the raw logits, then temperature, then top-k, min-p and top-p. Rows of a batch may mix
greedy and sampled requests. A greedy row's distribution is the one-hot of the argmax of
its penalized logits, so the same rejection rule serves both. A draw is keyed by the
request's seed and the token's position (``noise.py``): a seeded request reproduces its
tokens whatever else shares the batch. Logprobs are read from the raw logits, before any
transform. Nothing here reads the device back when RowParams comes from ``row_params``
(its host-side flags say which transforms any row uses), so the same calls run inside a
CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.sampling.noise import uniforms


@dataclass(slots=True)
class Penalties:
    """The penalties of the rows that have any; ``rows`` indexes the batch."""

    rows: torch.Tensor  # [m] int64
    repetition: torch.Tensor  # [m] float32, 1 = off
    presence: torch.Tensor  # [m] float32, 0 = off
    frequency: torch.Tensor  # [m] float32, 0 = off
    seen: torch.Tensor  # [m, vocab] bool: the token occurs in the prompt or the output so far
    counts: torch.Tensor  # [m, vocab] float32: its occurrences in the output so far


@dataclass(slots=True)
class RowParams:
    """Per-row sampling parameters of one logits batch."""

    temperature: torch.Tensor  # [rows] float32, 0 = greedy
    top_p: torch.Tensor  # [rows] float32, 1 = off
    top_k: torch.Tensor | None = None  # [rows] int64, <= 0 = off; None: off for every row
    min_p: torch.Tensor | None = None  # [rows] float32, 0 = off; None: off for every row
    penalties: Penalties | None = None
    banned: torch.Tensor | None = None  # [rows, vocab] bool: -inf (min_tokens' stop tokens)
    # host-side: the largest top_k of any row (0 = none, vocab = unknown: a full sort), and
    # whether any row is greedy / filters by top_p; None = read from the tensors
    top_k_max: int | None = None
    any_greedy: bool | None = None
    any_top_p: bool | None = None
    any_grammar: bool = False  # a row's ``banned`` comes from a grammar (may ban all it can reach)

    def flags(self) -> tuple[int, bool, bool, bool]:
        """(top_k_max, any min_p, any top_p, any greedy); reads the device only for a flag
        left None."""
        top_k_max = self.top_k_max
        if top_k_max is None:
            top_k_max = int(self.top_k.max()) if self.top_k is not None else 0
        any_min_p = self.min_p is not None
        any_top_p = self.any_top_p if self.any_top_p is not None else bool((self.top_p < 1).any())
        any_greedy = self.any_greedy if self.any_greedy is not None else bool((self.temperature == 0).any())
        return top_k_max, any_min_p, any_top_p, any_greedy


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """logits [rows, vocab] -> a penalized copy: repetition (positive logits divided,
    negative multiplied, over prompt + output tokens), then frequency and presence
    subtracted over output tokens."""
    out = logits.clone()
    sub = out[pen.rows]  # [m, vocab]
    rep = pen.repetition[:, None]
    scaled = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(pen.seen, scaled, sub)
    sub = sub - pen.frequency[:, None] * pen.counts
    sub = sub - pen.presence[:, None] * (pen.counts > 0).float()
    out[pen.rows] = sub
    return out


ARGMAX_CHUNK = 1024  # columns per first-pass block of argmax_rows
ARGMAX_MAX_ROWS = 64  # above it torch's one-pass reduction already fills the device


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] -> [rows] int64, the first maximum of each row: ``x.argmax(-1)``, in two
    passes (the maximum of each ARGMAX_CHUNK-column block, then of the blocks) when there
    are few rows of many columns on CUDA, where the one-pass reduction gives each row only
    a few blocks (28 us for one row of 128,256 on an H200)."""
    rows, n = x.shape
    if not x.is_cuda or rows > ARGMAX_MAX_ROWS or n < 16 * ARGMAX_CHUNK:
        return x.argmax(dim=-1)
    return two_pass_argmax(x)


def two_pass_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] -> [rows] int64: the first maximum of each row, block maxima first."""
    rows, n = x.shape
    pad = -n % ARGMAX_CHUNK
    blocks = F.pad(x, (0, pad), value=float("-inf")).view(rows, -1, ARGMAX_CHUNK)
    values, inside = blocks.max(dim=-1)  # [rows, n / CHUNK]: first maximum of each block
    block = values.argmax(dim=-1, keepdim=True)  # [rows, 1]: first block holding the maximum
    return (block * ARGMAX_CHUNK + inside.gather(1, block))[:, 0]


def process_logits(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """The logits every choice reads: min_tokens' ban, then penalties (a copy when either
    applies; ``logits`` is never modified)."""
    if params.banned is not None:
        masked = logits.masked_fill(params.banned, float("-inf"))
        logits = allowed_fallback(masked, params.banned) if params.any_grammar else masked
    if params.penalties is not None:
        logits = apply_penalties(logits, params.penalties)
    return logits


def allowed_fallback(masked: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """Rows left all -inf by ``banned`` (a drafter whose reduced vocabulary holds none of
    the tokens a grammar allows) become uniform over what ``banned`` allows, so a draft is
    still one the grammar takes; other rows are unchanged. No host read."""
    dead = (masked == float("-inf")).all(dim=-1, keepdim=True)
    uniform = torch.zeros_like(masked).masked_fill(banned, float("-inf"))
    return torch.where(dead, uniform, masked)


def top_k_mask(logits: torch.Tensor, top_k: torch.Tensor, k_max: int) -> torch.Tensor:
    """logits [rows, vocab], top_k [rows] (<= 0 = off), k_max >= every row's top_k (host)
    -> logits with everything below each row's k-th largest value at -inf (ties with it
    are kept, as vLLM does). The result does not depend on k_max."""
    vocab = logits.shape[-1]
    on = (top_k > 0) & (top_k < vocab)  # [rows]
    k = torch.where(on, top_k, 1)
    kth = logits.topk(min(max(k_max, 1), vocab), dim=-1).values.gather(-1, (k - 1)[:, None])  # [rows, 1]
    return logits.masked_fill((logits < kth) & on[:, None], float("-inf"))


def min_p_filter(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab], min_p [rows] -> renormalized probs without the tokens below
    min_p times the row's largest probability."""
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    kept = probs.masked_fill(probs < threshold, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab], top_p [rows] -> renormalized probs keeping, per row, the most
    likely tokens until their mass reaches top_p (at least one token)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def probs_for_rows(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """logits [rows, vocab] float32 (raw) -> probs [rows, vocab] after every transform.
    Greedy rows are one-hot at the argmax of their penalized logits."""
    top_k_max, any_min_p, any_top_p, any_greedy = params.flags()
    logits = process_logits(logits, params)
    temperature = params.temperature
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    if params.top_k is not None and top_k_max > 0:
        scaled = top_k_mask(scaled, params.top_k, top_k_max)
    probs = torch.softmax(scaled, dim=-1)
    if any_min_p:
        probs = torch.where((params.min_p > 0)[:, None], min_p_filter(probs, params.min_p), probs)
    if any_top_p:
        probs = torch.where((params.top_p < 1)[:, None], top_p_filter(probs, params.top_p), probs)
    if any_greedy:
        one_hot = torch.zeros_like(probs).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def probs_from_logits(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] float32; temperature, top_p [rows] -> probs [rows, vocab]
    (temperature and top-p only). Rows with temperature 0 are one-hot at the argmax."""
    return probs_for_rows(logits, RowParams(temperature, top_p))


def sample(
    probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, lane: int, any_sampled: bool = True
) -> torch.Tensor:
    """probs [rows, vocab] -> tokens [rows] int64, row i drawn with the uniform keyed by
    (seeds[i], positions[i], lane) by inverting its CDF. A one-hot row (greedy) gives its
    hot index whatever the seed; a token of probability 0 is never drawn. ``any_sampled``
    False (host-side: every row is one-hot) takes the argmax alone, the same tokens."""
    if not any_sampled:
        return probs.argmax(dim=-1)
    u = uniforms(seeds, positions, lane)  # [rows]
    cdf = probs.cumsum(dim=-1)  # [rows, vocab]
    token = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]).contiguous(), right=True)[:, 0]
    token = token.clamp(max=probs.shape[-1] - 1)
    # rounding in the scan can land on a zero-probability token: take the row's argmax then
    hit = probs.gather(-1, token[:, None])[:, 0] > 0
    return torch.where(hit, token, probs.argmax(dim=-1))


def logprobs_of(
    logits: torch.Tensor, chosen: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] raw, chosen [rows] -> (chosen_logprobs [rows], top_logprobs
    [rows, top_n], top_ids [rows, top_n]): log-softmax of the raw logits, before penalties
    and temperature (vLLM's default ``logprobs_mode``)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(top_n, dim=-1) if top_n else None
    chosen_lp = logp.gather(-1, chosen[:, None])[:, 0]
    if top is None:
        empty = logp.new_zeros(logp.shape[0], 0)
        return chosen_lp, empty, empty.long()
    return chosen_lp, top.values, top.indices
