"""Speculative-decoding counters.

AL (acceptance length) = tokens emitted per target forward in decode = accepted + 1,
averaged over verify steps. Prefill's first token is not a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ORIGINS = ("local", "transferred", "cold")
"""Where a request's drafter state came from: computed here (aggregated), received with
the target's pages (unified layout), or absent (separate layout: no prompt window)."""


@dataclass(slots=True)
class SpecStats:
    num_steps: int = 0  # verify forwards
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [K]: drafts accepted at i

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_steps += other.num_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted += other.num_accepted
        for i, n in enumerate(other.accepted_per_position):
            if i == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[i] += n

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verify step; 0.0 before the first step."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    acceptance_length: float  # 1.0 without speculation; 0.0 if no decode step ran
    cached_tokens: dict[str, int] = field(default_factory=dict)  # reused, per layer group
    num_steps: int = 0  # verify steps
    num_draft_tokens: int = 0
    num_accepted: int = 0
    queue_s: float = 0.0  # from arrival to first being scheduled (0: admitted directly)
