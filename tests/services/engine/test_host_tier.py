"""A prefix recalled from the host tier decodes exactly what a cold run decodes."""

from __future__ import annotations

from tests.services.engine.helpers import GREEDY, assert_pools_empty, make_engine, random_prompts


def test_a_recalled_prefix_gives_the_cold_greedy_output(pair):
    engine = make_engine(pair, k=2, num_pages=(40, 40), host_kv_cache_bytes=1 << 20, max_num_seqs=4)
    cold = make_engine(pair, k=2, enable_prefix_cache=False)
    a = random_prompts(1, seed=11, min_len=36, max_len=36)[0]
    first = engine.generate([a], GREEDY)[0].token_ids
    for other in random_prompts(4, seed=12, min_len=30, max_len=40):
        engine.generate([other], GREEDY)  # pushes a's pages out to the host tier
    assert engine.manager.usage()["target"].host_used > 0
    again = engine.generate([a], GREEDY)[0].token_ids
    assert engine.cache_stats().prefix["target"].recalled_tokens > 0
    assert again == first == cold.generate([a], GREEDY)[0].token_ids
    assert_pools_empty(engine)
    assert engine.manager.usage()["target"].host_used == 0
