"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_TEMPERATURE = 100.0


@dataclass(slots=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_p`` keeps the smallest set of most likely tokens
    whose mass reaches it; ``seed`` fixes the request's random stream; generation stops
    after ``max_tokens`` tokens, at EOS (unless ``ignore_eos``), at any of
    ``stop_token_ids``, or when the text contains one of ``stop`` (the text is cut before it)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop, self.stop_token_ids = tuple(self.stop), tuple(self.stop_token_ids)
        t = self.temperature
        if not isinstance(t, int | float) or not math.isfinite(t) or not 0 <= t <= MAX_TEMPERATURE:
            raise ValueError(f"temperature: must be in [0, {MAX_TEMPERATURE}], got {t!r}")
        p = self.top_p
        if not isinstance(p, int | float) or not math.isfinite(p) or not 0 < p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed: must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop: must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
