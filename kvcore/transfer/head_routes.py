"""Which KV heads each rank holds under tensor parallelism, and which rank sends which
heads to which when a prefill group of TP size P feeds a decode group of TP size D.

Head ownership (both sides and the model sharding use the same rule):
- when tp divides the heads, rank r holds the contiguous share
  ``[r * H / tp, (r + 1) * H / tp)``;
- when the heads divide tp (fewer heads than ranks), rank r holds the one head
  ``r // (tp / H)``, replicated on ``tp / H`` neighbouring ranks;
- otherwise the split is refused (registration names it).

A route moves one contiguous head range of one layer group from one sender rank to one
receiver rank. Its slices index the *local* head axis of each side's pool (pool shape
``[pages, layers, 2, heads, tokens_per_page, head_dim]``). Equal TP gives whole-pool routes
``i -> i``: pages move as they are. Where a head is replicated on several sender ranks,
receiver d takes it from the ``d``-th of them (mod the replicas), spreading the load.
Between one sender and one receiver there is at most one route per group.
"""

from __future__ import annotations

from dataclasses import dataclass


def heads_of_rank(total_heads: int, tp_size: int, rank: int) -> range:
    """Global KV-head indices that ``rank`` of ``tp_size`` holds."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"tp_rank: must be in [0, {tp_size}), got {rank}")
    if total_heads > 0 and total_heads % tp_size == 0:
        per = total_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    if total_heads > 0 and tp_size % total_heads == 0:
        head = rank // (tp_size // total_heads)
        return range(head, head + 1)
    raise ValueError(f"num_kv_heads: {total_heads} KV heads do not split over tp {tp_size}")


@dataclass(frozen=True, slots=True)
class HeadRoute:
    """Heads ``src_heads`` of sender rank ``src_rank``'s pool land in heads ``dst_heads``
    of receiver rank ``dst_rank``'s pool (local slices, equal lengths)."""

    src_rank: int
    dst_rank: int
    src_heads: slice
    dst_heads: slice
    whole: bool  # both slices span their whole pool: whole pages move unchanged

    @property
    def num_heads(self) -> int:
        return self.src_heads.stop - self.src_heads.start


def head_routes(total_heads: int, src_tp: int, dst_tp: int) -> list[HeadRoute]:
    """Every route of one layer group from a group of ``src_tp`` ranks to one of
    ``dst_tp``, ordered by receiver then sender."""
    routes = []
    for dst in range(dst_tp):
        held = heads_of_rank(total_heads, dst_tp, dst)
        runs: list[tuple[int, int, int]] = []  # (src rank, first head, end head)
        for head in held:
            src = _source_of(head, total_heads, src_tp, dst)
            if runs and runs[-1][0] == src and runs[-1][2] == head:
                runs[-1] = (src, runs[-1][1], head + 1)
            else:
                runs.append((src, head, head + 1))
        for src, lo, hi in runs:
            owned = heads_of_rank(total_heads, src_tp, src)
            src_heads = slice(lo - owned.start, hi - owned.start)
            dst_heads = slice(lo - held.start, hi - held.start)
            whole = hi - lo == len(owned) == len(held)
            routes.append(HeadRoute(src, dst, src_heads, dst_heads, whole))
    return routes


def _source_of(head: int, total_heads: int, src_tp: int, dst_rank: int) -> int:
    holders = [r for r in range(src_tp) if head in heads_of_rank(total_heads, src_tp, r)]
    return holders[dst_rank % len(holders)]


def routes_between(routes: list[HeadRoute], src_rank: int, dst_rank: int) -> HeadRoute | None:
    """The route from ``src_rank`` to ``dst_rank``, or None when they exchange nothing."""
    found = [r for r in routes if r.src_rank == src_rank and r.dst_rank == dst_rank]
    return found[0] if found else None
