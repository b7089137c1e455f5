"""How many pages each group gets out of one memory budget (bytes).

Full-attention groups need one slot per cached token each, so they share the budget in
proportion to page bytes and get equal page counts. A windowed OPTIONAL group needs only
what it can hold at once: every admissible sequence's window plus headroom, plus one
prefill chunk, so it is sized by that count and the target gets the rest. The target's
groups (REQUIRED; one per window of a per-layer mix) all get the shared count: a windowed
one too, as it may hold more than its windows (a prefix hit's re-run, cached pages).
"""

from __future__ import annotations

from kvcore.spec import CacheConfig, KVLayout, LayerGroupSpec, Lifecycle, cdiv


def windowed_pages_needed(group: LayerGroupSpec, config: CacheConfig) -> int:
    """Pages a windowed group can ever hold at once (+1 page per sequence for misalignment)."""
    p = config.tokens_per_page
    per_seq = cdiv(group.window - 1 + config.headroom_tokens, p) + 1
    return config.max_num_seqs * per_seq + cdiv(config.max_prefill_chunk, p)


def split_capacity(config: CacheConfig) -> tuple[int, ...]:
    """Page counts per group, in the order of ``config.groups``."""
    if config.num_pages:
        return config.num_pages
    p = config.tokens_per_page
    fixed: dict[str, int] = {}
    for g in config.groups:
        if g.window > 0 and g.lifecycle == Lifecycle.OPTIONAL:
            fixed[g.name] = windowed_pages_needed(g, config)
    fixed_bytes = sum(n * config.group(name).page_bytes(p) for name, n in fixed.items())
    shared = [g for g in config.groups if g.name not in fixed]
    if config.layout == KVLayout.SEPARATE:
        # The separate draft pool is sized like the target's, from its own share of bytes.
        shared = config.groups
        fixed, fixed_bytes = {}, 0
    bytes_per_page_set = sum(g.page_bytes(p) for g in shared)
    n_shared = (config.memory_bytes - fixed_bytes) // bytes_per_page_set
    if n_shared <= 0:
        raise ValueError(
            f"memory_bytes: {config.memory_bytes} bytes cannot hold the windowed "
            f"groups ({fixed_bytes} bytes) plus one page of every other group"
        )
    return tuple(fixed.get(g.name, n_shared) for g in config.groups)
