"""Block-table rules of one layer group, one class per kind of group.

A request's row in a group has one entry per page of its extent. The kinds differ in
which entries they hold and reuse:

- :class:`FullAttentionRows`: every query reads every key, so a row holds all its pages
  until the request ends, and a cached page is reusable wherever it is held;
- :class:`WindowedRows` (window W tokens): a query at q reads keys in (q - W, q], so
  pages wholly below every future query's window are released (their entries become
  ``NULL_PAGE``, always a leading run), and a cached match needs only the window at its
  end; a group that misses recomputes from far enough back for a stack of L layers
  (``kvcore/window.py`` holds the arithmetic).

:func:`rows_for` picks the class from the spec, as vLLM's ``spec_manager_map`` does.
"""

from __future__ import annotations

from kvcore import window as win
from kvcore.page_allocator import PageAllocator
from kvcore.spec import NULL_PAGE, LayerGroupSpec, cdiv


class FullAttentionRows:
    """Rows of a full-attention group. ``travels``: a transfer moves the group's pages."""

    def __init__(self, spec: LayerGroupSpec, tokens_per_page: int, travels: bool = True) -> None:
        self.spec, self.page, self.travels = spec, tokens_per_page, travels

    @property
    def name(self) -> str:
        return self.spec.name

    def stale_end(self, num_computed: int) -> int:
        """Pages [0, end) that no query at ``num_computed`` or later reads: none."""
        return 0

    def initial_row(
        self, reused: list[int | None], compute_start: int, num_computed: int, extent: int
    ) -> list[int | None]:
        """A new request's row of ``extent`` entries.

        - ``reused``: the matched prefix (page ids, NULL where the cache holds nothing,
          None for a page recalled from the host tier, which takes a new page);
        - entries below ``stale_end(num_computed)`` are NULL (KV that arrives by transfer
          and that no later query reads), and so are those below ``compute_start`` that
          the match did not cover;
        - every other entry is None: a new page goes there.
        """
        stale = min(self.stale_end(num_computed), extent)
        row = list(reused)
        row[:stale] = [NULL_PAGE] * min(stale, len(row))
        first_new = min(max(len(row), compute_start // self.page, stale), extent)
        return row + [NULL_PAGE] * (first_new - len(row)) + [None] * (extent - first_new)

    def release_stale(self, row: list[int], first_held: int, num_computed: int, pages: PageAllocator) -> int:
        """Release the pages no query at ``num_computed`` or later reads; returns the new
        first held entry. Full attention releases nothing."""
        return first_held

    def transfer_range(self, num_tokens: int, held: int) -> tuple[int, int]:
        """Block-table indices [first, end) a transfer of positions [0, num_tokens) moves,
        skipping the receiver's ``held`` leading entries."""
        end = cdiv(num_tokens, self.page)
        return min(max(self.stale_end(num_tokens), held), end), end

    def first_read_page(self, position: int) -> int:
        """First page a query at ``position`` reads: page 0."""
        return 0

    def compute_start(self, match_end: int, window_held: bool) -> int:
        """Where this group's prefill starts when a match ends at ``match_end``: there
        when the cache holds what a query there reads, else from the start."""
        return match_end if window_held else 0


class WindowedRows(FullAttentionRows):
    """Rows of a sliding-window group. ``keep`` is the window its pages are kept for: W,
    or W + 1 for a target that feeds another group (a later match at n re-runs it from
    n - 1)."""

    def __init__(
        self, spec: LayerGroupSpec, tokens_per_page: int, travels: bool = True, keep: int = 0
    ) -> None:
        super().__init__(spec, tokens_per_page, travels)
        self.keep = keep or spec.window

    def stale_end(self, num_computed: int) -> int:
        """Pages [0, (n - W + 1) // P) lie wholly below every future query's window."""
        return win.stale_page_end(num_computed, self.spec.window, self.page)

    def release_stale(self, row: list[int], first_held: int, num_computed: int, pages: PageAllocator) -> int:
        """Release pages [first_held, (n - keep + 1) // P), which no later query reads (nor
        a re-run from n - 1, for a feeding target); their entries become NULL."""
        end = (num_computed - self.keep + 1) // self.page
        if end <= first_held:
            return first_held
        end = min(end, len(row))
        pages.decref(row[first_held:end])
        row[first_held:end] = [NULL_PAGE] * (end - first_held)
        return end

    def first_read_page(self, position: int) -> int:
        """First page a query at ``position`` reads: the one holding its window's start."""
        return win.window_start(position, self.spec.window) // self.page

    def compute_start(self, match_end: int, window_held: bool) -> int:
        """There when the window at ``match_end`` is held, else far enough back that every
        key a query there reads is exact through all of the group's layers."""
        if window_held:
            return match_end
        return win.recompute_start(match_end, self.spec.window, self.spec.num_layers)


def rows_for(spec: LayerGroupSpec, tokens_per_page: int, travels: bool, fed: bool) -> FullAttentionRows:
    """The rules of ``spec``'s kind. ``fed``: another group reads this one's features (the
    target of a drafter), so a windowed one keeps one more position."""
    if spec.window > 0:
        return WindowedRows(spec, tokens_per_page, travels, spec.window + fed)
    return FullAttentionRows(spec, tokens_per_page, travels)
