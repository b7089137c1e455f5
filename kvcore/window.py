"""Sliding-window page arithmetic, in tokens and page indices.

A query at position q of a group with window W attends keys at positions (q - W, q].
After ``num_computed`` tokens, every later query sits at q >= num_computed, so keys
below ``num_computed - W + 1`` are never read again.
"""

from __future__ import annotations


def stale_page_end(num_computed: int, window: int, tokens_per_page: int) -> int:
    """Pages [0, end) lie wholly below every future query's window; 0 for full attention."""
    if window <= 0:
        return 0
    return max(0, num_computed - window + 1) // tokens_per_page


def window_start(position: int, window: int) -> int:
    """First key position a query at ``position`` attends (0 for full attention)."""
    if window <= 0:
        return 0
    return max(0, position - window + 1)


def recompute_start(match_end: int, window: int, num_layers: int) -> int:
    """First position whose KV a windowed stack of ``num_layers`` layers must recompute so
    that every key a query at ``match_end`` or later reads is exact. Layer l's KV at
    position j depends on layer l-1's keys in (j - W, j], so the reach grows by W - 1
    per layer below the top one."""
    if window <= 0:
        return 0
    return max(0, match_end - num_layers * (window - 1))
