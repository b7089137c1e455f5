"""The router's estimate of what each worker has cached (prefill: prompts; decode: prompts
and their outputs).

Keyed by chained hashes of whole pages of prompt tokens, as the workers' prefix caches
are. Every prompt the router sends to a worker is recorded there; entries are dropped
least recently used first beyond ``max_pages_per_worker``. It is an estimate: a worker
may have evicted what the index still lists.
"""

from __future__ import annotations

from collections import OrderedDict


def page_hashes(token_ids: list[int], tokens_per_page: int) -> list[int]:
    """Chained hash of each whole page: page i's hash covers tokens [0, (i+1) * P)."""
    out, h = [], 0
    for start in range(0, len(token_ids) - tokens_per_page + 1, tokens_per_page):
        h = hash((h, tuple(token_ids[start : start + tokens_per_page])))
        out.append(h)
    return out


class PrefixIndex:
    def __init__(self, tokens_per_page: int, max_pages_per_worker: int = 1 << 16) -> None:
        self.page = tokens_per_page
        self.max_pages = max_pages_per_worker
        self.workers: dict[str, OrderedDict[int, None]] = {}

    def record(self, worker_id: str, token_ids: list[int]) -> None:
        pages = self.workers.setdefault(worker_id, OrderedDict())
        for h in page_hashes(token_ids, self.page):
            pages[h] = None
            pages.move_to_end(h)
        while len(pages) > self.max_pages:
            pages.popitem(last=False)

    def cached_tokens(self, worker_id: str, token_ids: list[int]) -> int:
        """Tokens of the longest prefix of whole pages the worker is believed to hold."""
        return self.held_tokens(worker_id, page_hashes(token_ids, self.page))

    def held_tokens(self, worker_id: str, hashes: list[int]) -> int:
        """``cached_tokens`` from the prompt's ``page_hashes``, computed once per request."""
        pages = self.workers.get(worker_id)
        if not pages:
            return 0
        n = 0
        for h in hashes:
            if h not in pages:
                break
            n += self.page
        return n

    def forget(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
