"""Random operation sequences against the manager; invariants checked after every step."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore import NULL_PAGE, KVLayout
from kvcore.window import stale_page_end
from tests.kvcore.conftest import make_manager, request_rows, store

DOCS = [[d * 1000 + i for i in range(64)] for d in range(3)]


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = None
        self.live: dict[str, dict] = {}  # request id -> {tokens, first_private: {group: idx}}
        self.next_id = 0

    @rule(
        window=st.sampled_from([0, 3, 8, 13]),
        page=st.sampled_from([1, 4, 5]),
        k=st.integers(0, 4),
        layout=st.sampled_from(list(KVLayout)),
        draft_layers=st.integers(1, 2),
        pages=st.integers(6, 40),
        host_pages=st.sampled_from([0, 0, 6, 30]),
    )
    @precondition(lambda self: self.manager is None)
    def build(self, window, page, k, layout, draft_layers, pages, host_pages):
        self.manager = make_manager(
            page=page,
            window=window,
            k=k,
            layout=layout,
            draft_layers=draft_layers,
            target_pages=pages,
            draft_pages=pages,
            host_pages=host_pages,
        )

    @rule(
        doc=st.integers(0, 2),
        cut=st.integers(0, 40),
        tail=st.lists(st.integers(0, 9), max_size=12),
        reserve=st.booleans(),
    )
    @precondition(lambda self: self.manager is not None)
    def start(self, doc, cut, tail, reserve):
        tokens = DOCS[doc][:cut] + tail
        if len(tokens) < 1:
            return
        m = self.manager
        rid = f"r{self.next_id}"
        self.next_id += 1
        if reserve:  # decode side: pages whose KV arrives by transfer
            if not m.can_allocate(len(tokens), num_computed=len(tokens)):
                return
            m.allocate(rid, len(tokens), num_computed=len(tokens))
            private = {g: 0 for g in m.groups}
        else:
            match = m.match_prefix(tokens)
            if not m.can_allocate(len(tokens), match):
                return
            m.allocate(rid, len(tokens), match)
            private = {g: len(match.reused_pages[g]) for g in m.groups}
        m.advance(rid, len(tokens))
        self.live[rid] = {"tokens": list(tokens), "private": private}

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def decode_step(self, data):
        m = self.manager
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        n = len(req["tokens"])
        if not m.can_extend(rid, n):
            return
        m.extend(rid, n)
        accepted = data.draw(st.integers(1, m.config.num_spec_tokens + 1))
        assert (n + accepted - 1) < len(m.block_table(rid, "target")) * m.tokens_per_page  # headroom holds
        req["tokens"] += data.draw(st.lists(st.integers(0, 9), min_size=accepted, max_size=accepted))
        m.advance(rid, n + accepted)

    @rule(data=st.data(), cache=st.booleans())
    @precondition(lambda self: self.live)
    def finish(self, data, cache):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live.pop(rid)
        self.manager.free(rid, req["tokens"] if cache else None)

    @rule()
    @precondition(lambda self: self.manager is not None)
    def reset_cache(self):
        self.manager.reset_prefix_cache()

    @invariant()
    def pages_have_exactly_their_holders(self):
        m = self.manager
        if m is None:
            return
        for g, alloc in store(m).allocators.items():
            holders = Counter()
            for req in request_rows(m).values():
                holders.update(p for p in req.rows[g] if p != NULL_PAGE)
            if store(m).tree is not None and g in store(m).cached_groups:
                for node in store(m).tree.nodes():
                    holders.update(p for p in node.pages[g] if p != NULL_PAGE)
            assert all(c >= 0 for c in alloc.ref_counts)
            assert [holders.get(p, 0) for p in range(alloc.num_pages)] == alloc.ref_counts
            free = list(alloc.free_queue)
            assert len(free) == len(set(free))
            assert set(free) == {p for p, c in enumerate(alloc.ref_counts) if c == 0}
            assert alloc.num_used + alloc.num_free == alloc.num_pages
        if store(m).host is not None:  # host pages: held by exactly one entry each
            for g, alloc in store(m).host.allocators.items():
                held = Counter(e[g] for e in store(m).host.entries.values() if e[g] != NULL_PAGE)
                assert all(n == 1 for n in held.values())
                assert [held.get(p, 0) for p in range(alloc.num_pages)] == alloc.ref_counts

    @invariant()
    def written_pages_have_one_owner(self):
        m = self.manager
        if m is None:
            return
        for rid, req in self.live.items():
            for g, row in request_rows(m)[rid].rows.items():
                for p in row[req["private"][g] :]:
                    assert p == NULL_PAGE or store(m).allocators[g].ref_counts[p] == 1, (rid, g, row)

    @invariant()
    def window_pages_are_held_and_stale_pages_released(self):
        m = self.manager
        if m is None:
            return
        for rid in self.live:
            r = request_rows(m)[rid]
            for g, row in r.rows.items():
                stale = stale_page_end(r.num_computed, m.groups[g].window, m.tokens_per_page)
                assert all(p == NULL_PAGE for p in row[:stale])
                assert all(p != NULL_PAGE for p in row[stale:])
                window = m.groups[g].window
                first_read = max(0, r.num_computed - window + 1) if window else 0
                for pos in range(first_read, r.num_computed):  # keys the next query reads
                    assert row[pos // m.tokens_per_page] != NULL_PAGE

    @invariant()
    def evictable_counts_add_up(self):
        m = self.manager
        if m is None or store(m).tree is None:
            return
        expected = Counter()
        for node in store(m).tree.nodes():
            if node.lock_ref == 0:
                for g, ps in node.pages.items():
                    expected[g] += sum(p != NULL_PAGE for p in ps)
        assert {g: expected.get(g, 0) for g in store(m).tree.evictable} == store(m).tree.evictable

    @invariant()
    def cached_counts_add_up_and_every_candidate_is_in_its_heap(self):
        """The counts kept without a walk equal a walk's, and each node that eviction or a
        drop may take has a current entry in its heap (``kvcore/radix_lru.py``)."""
        m = self.manager
        if m is None or store(m).tree is None:
            return
        tree, held = store(m).tree, Counter()
        for node in tree.nodes():
            for g, ps in node.pages.items():
                held[g] += sum(p != NULL_PAGE for p in ps)
        assert tree.num_cached_pages() == {g: held.get(g, 0) for g in tree.cached}
        for node in tree.nodes():  # the partial match's index mirrors the children
            assert {k: c for same in node.by_first.values() for k, c in same.items()} == node.children
            assert all(k[0] == first for first, same in node.by_first.items() for k in same)
        for heap in (tree._leaves, tree._holders):
            current = {id(n) for stamp, _, n in heap._heap if stamp == n.last_access}
            assert all(id(n) in current for n in tree.nodes() if heap.is_candidate(n))

    def teardown(self):
        m = self.manager
        if m is None:
            return
        for rid in list(self.live):
            m.free(rid, self.live.pop(rid)["tokens"])
        m.reset_prefix_cache()
        for g, usage in m.usage().items():
            assert usage.used == 0, g
            assert usage.host_used == 0, g


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(
    max_examples=500, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
