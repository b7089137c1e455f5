"""The drafter's input rows follow the published EAGLE-3 convention: its slot 0 is written
but no query reads it (``DRAFT_KEY_START``), so poisoning that slot changes nothing."""

from __future__ import annotations

import math

import services.engine.engine as engine_module
from kvcore import DRAFT_GROUP
from services.engine.models.eagle import DRAFT_KEY_START
from services.engine.request import Status
from services.engine.sampling.params import SamplingParams
from tests.services.engine.helpers import WINDOW, assert_pools_empty, make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPT = [3, 1, 4, 1, 5, 9, 2]  # shorter than the drafter's window: slot 0 stays in reach


def run(pair, poison_slot: int | None, monkeypatch):
    """(tokens, every step's drafts) of one request; ``poison_slot``: a draft-group position
    filled with NaN once the prefill wrote it."""
    drafted = []

    def recording_draft(*args):
        drafts = draft(*args)
        drafted.append(drafts.token_ids.tolist())
        return drafts

    draft = engine_module.draft
    monkeypatch.setattr(engine_module, "draft", recording_draft)
    engine = make_engine(pair, k=3)
    rid = engine.add_request(PROMPT, GREEDY)
    final = None
    while engine.has_unfinished():
        outputs = engine.step()
        req = engine.requests.get(rid)
        if poison_slot is not None and req is not None and req.status is Status.DECODE:
            page = engine.manager.block_tables([rid], DRAFT_GROUP, "cpu")[0, 0].item()
            engine.kv_pools.tensor(DRAFT_GROUP)[page, :, :, :, poison_slot] = math.nan
            poison_slot = None
        final = next((o for o in outputs if o.finished), final)
    monkeypatch.undo()
    assert_pools_empty(engine)
    return final.token_ids, drafted


def test_slot_zero_is_never_read(pair, monkeypatch):
    assert DRAFT_KEY_START == 1 and len(PROMPT) < WINDOW
    clean = run(pair, None, monkeypatch)
    assert run(pair, 0, monkeypatch) == clean
    tokens, drafted = run(pair, 1, monkeypatch)  # slot 1 is a key: NaN there spoils drafts
    assert tokens == clean[0] and drafted != clean[1]
