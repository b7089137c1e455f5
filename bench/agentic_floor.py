"""The prefix an unbounded prompt cache would reuse: the floor of prefilled tokens.

A prefill worker sees prompts only (answers reach it as part of the next prompt) and caches
whole pages. So the most a turn can reuse is its longest common prefix with the whole pages of
a prompt whose prefill had completed when the turn was sent, leaving the last prompt token to
compute. An aggregated worker also caches answers, so it can reuse more than this floor.
"""

from __future__ import annotations

from bench.agentic_workload import Tokens


def common_prefix_len(a: Tokens, b: Tokens) -> int:
    """Length of the longest common prefix (binary search over C-speed slice compares)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


class PromptCacheFloor:
    """Whole-page prompts seen so far; ``best_hit`` is the unbounded cache's match."""

    def __init__(self, tokens_per_page: int) -> None:
        self.page = tokens_per_page
        self.cached: list[Tokens] = []

    def add(self, prompt: Tokens) -> None:
        whole = len(prompt) // self.page * self.page
        if whole:
            self.cached.append(prompt[:whole])

    def best_hit(self, prompt: Tokens) -> int:
        best = max((common_prefix_len(prompt, seq) for seq in self.cached), default=0)
        return min(best, max(0, len(prompt) - 1))
