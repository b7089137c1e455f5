"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.grammar import Constraint

MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 1e-5  # below it a temperature is greedy (vLLM's _SAMPLING_EPS): logits / 1e-38 overflow
MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI)
MAX_STOP_STRINGS = 16  # stop strings per request (OpenAI takes 4; each is matched per step)
MAX_STOP_CHARS = 256  # characters per stop string


@dataclass(slots=True)
class SamplingParams:
    """How one request picks its tokens; the transforms run in vLLM v1's order:

    1. ``min_tokens``: the first ``min_tokens`` tokens never end the request: EOS (unless
       ``ignore_eos``) and ``stop_token_ids`` get -inf while fewer were generated, and a
       stop string counts only where it begins after their text (stopping.append_tokens);
    2. penalties on the raw logits: ``repetition_penalty`` (1 = off) over prompt and output
       tokens (a positive logit is divided by it, a negative one multiplied), then
       ``frequency_penalty`` (times each output token's count) and ``presence_penalty``
       (once per distinct output token) subtracted, OpenAI's semantics;
    3. ``temperature`` (0 = greedy: the argmax of the penalized logits; a temperature below
       MIN_TEMPERATURE is stored as 0, so every entry point treats it as greedy);
    4. ``top_k`` (0 or -1 = off), ``min_p`` (0 = off: drop tokens below min_p times the
       most likely one's probability), ``top_p`` (the smallest set of most likely tokens
       whose mass reaches it).

    ``seed`` fixes the request's random stream. Generation stops after ``max_tokens``
    tokens, at EOS (unless ``ignore_eos``), at any of ``stop_token_ids``, or when the text
    contains one of ``stop`` (the text is cut before it). ``logprobs`` = N asks for each
    emitted token's log-probability and its N most likely alternatives (None = none).
    ``structured``: the grammar the output must match (structured outputs; None = none):
    every row's logits are masked to the tokens it allows, EOS only where it is complete."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    structured: Constraint | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop, self.stop_token_ids = tuple(self.stop), tuple(self.stop_token_ids)
        _number("temperature", self.temperature, 0, MAX_TEMPERATURE)
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        p = self.top_p
        if not _is_number(p) or not 0 < p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {p!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed: must be an integer or None, got {self.seed!r}")
        _check_stop(self.stop)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k: must be an integer >= -1 (0 or -1 = off), got {self.top_k!r}")
        _number("min_p", self.min_p, 0, 1)
        r = self.repetition_penalty
        if not _is_number(r) or not r > 0:
            raise ValueError(f"repetition_penalty: must be a number > 0 (1 = off), got {r!r}")
        _number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens: must be an integer in [0, max_tokens = "
                f"{self.max_tokens}], got {self.min_tokens!r}"
            )
        if self.structured is not None and not isinstance(self.structured, Constraint):
            raise ValueError(f"structured: must be a Constraint or None, got {self.structured!r}")
        n = self.logprobs
        if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
            raise ValueError(f"logprobs: must be an integer in [0, {MAX_LOGPROBS}] or None, got {n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _check_stop(stop: tuple) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"stop: must be non-empty strings, got {stop!r}")
    longest = max(stop, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise ValueError(f"stop: at most {MAX_STOP_CHARS} characters a string, got {len(longest)}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _number(name: str, value, low: float, high: float) -> None:
    if not _is_number(value) or not low <= value <= high:
        raise ValueError(f"{name}: must be in [{low:g}, {high:g}], got {value!r}")
