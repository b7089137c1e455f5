"""services/engine/memory_profile.py on the CPU: the profile forward runs the real models
over a throwaway cache and leaves nothing behind (its CUDA readings feed memory_budget.py,
tested with stated readings in test_memory_budget.py)."""

from __future__ import annotations

import logging

from services.engine.memory_budget import profile_lengths, profile_tokens
from services.engine.memory_profile import profile_step
from tests.services.engine.helpers import GREEDY, make_engine


def test_the_profile_forward_leaves_no_page_request_or_prefix_behind(pair):
    engine = make_engine(pair, k=2, max_model_len=40)
    before = engine.generate([[1, 2, 3, 4, 5]], GREEDY)[0].token_ids
    engine.manager.reset_prefix_cache()
    # 64 tokens of budget, 16 sequences x 3: the widest step runs 64 tokens, as 39 + 25
    assert profile_lengths(profile_tokens(64, 16, 2), 40) == [39, 25]
    assert profile_step(engine, engine.manager.config) == 0  # no CUDA readings on the CPU
    assert {name: u.used for name, u in engine.manager.usage().items()} == {"target": 0, "draft": 0}
    assert not engine.requests and not engine.manager.has_request("memory-profile-0")
    assert engine.generate([[1, 2, 3, 4, 5]], GREEDY)[0].token_ids == before


def test_each_layer_group_and_the_scheduling_are_logged_at_start(pair, caplog):
    with caplog.at_level(logging.INFO, logger="services.engine.setup"):
        make_engine(pair, k=2, num_pages=(256, 64))
    # random pair: 3 target layers, 1 drafter layer, 2 KV heads of 16, float32, 4-token pages
    assert [r.getMessage() for r in caplog.records] == [
        "KV cache group target: 256 pages, 1024 tokens, 0.8 MiB",
        "KV cache group draft: 64 pages, 256 tokens, 0.1 MiB",
        "scheduling: decode-first steps, 64 tokens a step, 16 sequences",  # auto on the CPU
    ]
