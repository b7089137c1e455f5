"""What the manager hands out for a disaggregated transfer: plain data."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TransferPages:
    """Pages of one group that a transfer moves: block-table indices
    [first_page, first_page + len(page_ids)), i.e. positions from first_page * P."""

    first_page: int
    page_ids: list[int]


@dataclass(frozen=True, slots=True)
class Reservation:
    """Pages reserved for a request whose prompt KV arrives by transfer.

    - ``block_tables``: per group, in the cache's group order, the request's row: one entry
      per page of positions [0, num_tokens), ``NULL_PAGE`` where nothing is held (out of a
      window, or not sent);
    - ``num_held``: per group, leading entries whose KV the decode side already holds
      (prefix cache or host tier); the sender skips them;
    - ``num_tokens`` = ``prompt_len`` + the cache's headroom.
    """

    request_id: str
    prompt_len: int
    num_tokens: int
    block_tables: dict[str, list[int]]
    num_held: dict[str, int]
