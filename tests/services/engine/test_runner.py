"""ModelRunner.context: the index tensors of a paged forward, built on the host, against a
token-by-token reading of the block tables."""

from __future__ import annotations

import torch

from kvcore import DRAFT_GROUP
from kvcore.spec import NULL_PAGE
from services.engine.runner import Span
from services.engine.sampling.params import SamplingParams
from tests.services.engine.helpers import assert_pools_empty, make_engine


def expected_slots(table: list[list[int]], spans: list[Span], page: int) -> list[int]:
    slots = []
    for row, span in zip(table, spans, strict=True):
        for position in range(span.start, span.start + len(span.token_ids)):
            index = position // page
            page_id = row[index] if index < len(row) else NULL_PAGE
            held = page_id != NULL_PAGE and position >= span.write_start
            slots.append(page_id * page + position % page if held else -1)
    return slots


def test_context_indexes_every_token_of_every_span(pair):
    engine = make_engine(pair, k=2)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = [engine.add_request(list(range(1, 1 + n)), greedy) for n in (11, 7, 3)]
    engine.step()  # the prompts' pages are allocated and written
    spans = [
        Span(ids[0], 2, [5] * 7, write_start=6),  # a span partly cached: slots before 6 skipped
        Span(ids[1], 0, [1] * 7),
        Span(ids[2], 1, [2]),
    ]
    page = engine.manager.tokens_per_page
    for group in [g.name for g in engine.runner.target_groups] + [DRAFT_GROUP]:
        ctx = engine.runner.context(group, spans, window=0)
        table = engine.manager.block_tables(ids, group).tolist()
        assert ctx.slot_mapping.tolist() == expected_slots(table, spans, page)
        assert ctx.slot_mapping.dtype == torch.int64
        assert ctx.batch.block_table.tolist() == table
        assert ctx.batch.seq_lens.tolist() == [9, 7, 2]
        assert ctx.batch.query_start_loc.tolist() == [0, 7, 14, 15]
        assert ctx.batch.max_q_len == 7
    for rid in ids:
        engine.abort(rid)
    assert_pools_empty(engine)


def test_context_of_no_spans_is_empty(pair):
    engine = make_engine(pair, k=0)
    ctx = engine.runner.context(engine.runner.target_groups[0].name, [], window=0)
    assert ctx.slot_mapping.tolist() == []
    assert ctx.batch.query_start_loc.tolist() == [0]
    assert ctx.batch.max_q_len == 0
