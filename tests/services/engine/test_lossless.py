"""Greedy speculative decoding equals the target's plain greedy decoding, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcore import KVLayout
from models.data import split_files
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling.params import SamplingParams
from tests.services.engine.helpers import WINDOW, assert_pools_empty, make_engine, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TINY = Path(__file__).resolve().parents[3] / "models"


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(24, seed=1, max_len=5 * WINDOW)  # mixed lengths, most past the window


@pytest.fixture(scope="module")
def reference(pair, prompts):
    return [o.token_ids for o in make_engine(pair, k=0).generate(prompts, GREEDY)]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_spec_equals_target_only(pair, prompts, reference, k):
    engine = make_engine(pair, k=k)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference
    stats = engine.stats["local"]
    assert stats.num_draft_tokens == k * stats.num_steps
    assert stats.num_accepted > 0  # some drafts were accepted and caught up
    assert all(o.usage.acceptance_length >= 1.0 for o in outputs)
    assert_pools_empty(engine)


@pytest.mark.parametrize("layout", [KVLayout.UNIFIED, KVLayout.SEPARATE])
def test_prefix_hits_with_complete_and_incomplete_draft_windows(pair, layout):
    g = torch.Generator().manual_seed(7)
    base = torch.randint(0, 31, (40,), generator=g).tolist()
    first = [base + [5]]
    variants = [
        base[:m] + torch.randint(0, 31, (6,), generator=g).tolist() for m in (3, 8, 13, 21, 30, 37, 40)
    ] + [base + [5]]
    reference = make_engine(pair, k=0, enable_prefix_cache=False)
    engine = make_engine(pair, k=3, layout=layout)
    got = [o.token_ids for o in engine.generate(first, GREEDY)]
    # prompts extending the first request's cached pages: its last draft window is held
    full = first[0] + got[0]
    variants += [full[:n] + [30, 29] for n in range(len(full) - 1, len(full) - 9, -1)]
    got += [o.token_ids for o in engine.generate(variants, GREEDY)]
    assert got == [o.token_ids for o in reference.generate(first + variants, GREEDY)]
    assert engine.cache_stats().prefix["target"].hit_tokens > 0
    assert engine.cache_stats().prefix["draft"].recomputed_tokens > 0  # windows refilled
    if layout == KVLayout.UNIFIED:
        assert engine.cache_stats().prefix["draft"].hit_tokens > 0  # windows reused
    assert_pools_empty(engine)


def test_single_token_prompts_and_one_token_outputs(pair):
    prompts = [[3], [7, 1], [4] * 9]
    params = [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)] * 3
    ref = [o.token_ids for o in make_engine(pair, k=0).generate(prompts, params)]
    engine = make_engine(pair, k=4)
    assert [o.token_ids for o in engine.generate(prompts, params)] == ref
    assert_pools_empty(engine)


def held_out_snippets(count: int, seed: int) -> list[str]:
    """Mixed-length snippets (8 to 400 bytes) of held-out standard-library files."""
    _, held = split_files()
    g = torch.Generator().manual_seed(seed)
    texts = [p.read_text(errors="replace") for p in held]
    texts = [t for t in texts if len(t) > 700]
    out = []
    for i in range(count):
        text = texts[i % len(texts)]
        n = int(torch.randint(8, 400, (1,), generator=g))
        start = int(torch.randint(0, len(text) - n, (1,), generator=g))
        out.append(text[start : start + n])
    return out


@pytest.mark.skipif(
    not (TINY / "tiny-drafter" / "model.safetensors").is_file(), reason="the bundled tiny pair is not present"
)
def test_bundled_pair_is_lossless_on_fifty_prompts():
    prompts = held_out_snippets(50, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    common = dict(
        model=str(TINY / "tiny-target"), max_num_seqs=64, num_pages=(1024, 512), max_num_batched_tokens=2048
    )
    plain = Engine(EngineConfig(num_spec_tokens=0, **common)).generate(prompts, params)
    spec = Engine(EngineConfig(drafter=str(TINY / "tiny-drafter"), num_spec_tokens=4, **common))
    outputs = spec.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert spec.stats["local"].acceptance_length > 2.0  # the trained drafter is useful
    assert_pools_empty(spec)
