"""A request's state inside the engine, and what the engine hands back.

Positions: the request's tokens are ``prompt_ids + output_ids``; the target holds valid KV
for positions [0, num_computed), and num_computed == len(tokens) - 1 while decoding (the
last token's KV is written by the next verify). The drafter's slots [0, draft_valid) are
exact (computed from true target features); the slots from ``pending_start`` on are
computed by the next draft forward from ``pending_tokens`` and ``pending_features``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvcore import AuxState
from services.engine.grammar import RequestGrammar
from services.engine.sampling.params import SamplingParams
from services.engine.stats import SpecStats, Usage


class Status(enum.Enum):
    WAITING = "waiting"  # queued; holds no pages
    PREFILL = "prefill"  # admitted; prompt chunks still to run
    DECODE = "decode"
    PARKED = "parked"  # prefill-only request done; holds its pages until released
    FINISHED = "finished"


@dataclass(slots=True)
class TokenLogprob:
    """One emitted token's log-probability under the target, and its most likely
    alternatives: log-softmax of the target's raw logits (before penalties and temperature)."""

    token_id: int
    logprob: float
    top_ids: list[int]  # [N] most likely first
    top_logprobs: list[float]  # [N]


@dataclass(slots=True)
class RequestOutput:
    """One step's news for one request. ``text`` and ``token_ids`` cover the whole output
    so far (the text cut before a matched stop string once finished); under the "delta"
    output kind (config.OUTPUT_KINDS) ``token_ids`` and ``logprobs`` are this step's alone
    (equal to ``new_token_ids``) and ``text`` is empty."""

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "prefilled"
    usage: Usage
    aux: AuxState | None = None
    # aligned with token_ids when sampling.logprobs is set, else None; an entry is None for
    # a token whose logprob was computed elsewhere (a prefilled request's first token)
    logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class PrefillSpan:
    """Target positions [start, end) that this step's prefill chunk runs."""

    start: int
    end: int


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        seed: int | None,
        prefill_only: bool = False,
        origin: str = "local",
        num_spec_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.output_logprobs: list[TokenLogprob | None] = []  # only with sampling.logprobs
        self.num_spec_tokens = num_spec_tokens  # drafts verified per step, at most the engine's K
        self.sampling = sampling
        self.seed = seed  # keys every draw (noise.py); None for greedy requests
        self.prefill_only = prefill_only
        self.forced_first: int | None = None  # the first token, when not sampled (a retried prefill)
        self.origin = origin
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_text_len: int | None = None  # output text length before a matched stop
        self.stop_search_floor = 0  # a stop string must begin here or later (min_tokens)
        self.spec = SpecStats()
        self.cached_tokens: dict[str, int] = {}  # prompt tokens reused per layer group
        self.grammar: RequestGrammar | None = None  # set by the engine with sampling.structured
        self.arrival_s = time.monotonic()
        self.queue_s = 0.0  # arrival to first scheduled; stays 0 when admitted directly
        self.reset_kv_state()

    def reset_kv_state(self) -> None:
        """Forget everything tied to pages (on admission and preemption)."""
        self.num_computed = 0
        self.prefill_pos = 0  # next position the prefill runs
        self.prefill_end = 0  # positions the prefill covers (len(tokens) at admission)
        self.target_write_start = 0
        self.draft_write_start = 0
        self.draft_valid = 0
        self.last_feature: torch.Tensor | None = None  # [hidden] f_{num_computed - 1}
        self.pending_start = 0
        self.pending_tokens: list[int] = []
        self.pending_features: list[torch.Tensor] = []  # [n_i, hidden] pieces, sum n_i = len(pending_tokens)
        self.aux: AuxState | None = None

    @property
    def tokens(self) -> list[int]:
        """Prompt then output: a new list, O(length); a step's hot path reads
        ``last_token`` or ``token_range`` instead."""
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        """tokens[-1] without building ``tokens`` (O(1): read every decode step)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token_range(self, start: int, end: int) -> list[int]:
        """tokens[start:end] (0 <= start <= end) without building ``tokens``."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def cacheable_len(self) -> int:
        """Leading positions whose KV is exact in every group (offered to the prefix cache)."""
        return min(self.num_computed, self.draft_valid)

    def usage(self, speculative: bool) -> Usage:
        al = self.spec.acceptance_length if speculative else (1.0 if self.spec.num_steps else 0.0)
        return Usage(
            len(self.prompt_ids),
            len(self.output_ids),
            al,
            dict(self.cached_tokens),
            self.spec.num_steps,
            self.spec.num_draft_tokens,
            self.spec.num_accepted,
            self.queue_s,
        )


@dataclass(slots=True)
class StepPlan:
    """What one engine step runs: prefill chunks and decode (draft + verify) requests."""

    prefill: list[tuple[Request, PrefillSpan]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
