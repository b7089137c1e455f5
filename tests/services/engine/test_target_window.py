"""A windowed target (a random Mistral checkpoint saved by ``transformers``, window 24)
served by the engine on CPU float32 gives transformers' greedy tokens, with prefill
chunks shorter and longer than the window, with and without a windowed EAGLE-3 drafter,
through prefix-cache hits, and frees every page."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.models import Eagle3Drafter, LlamaConfig, save_model
from services.engine.models.config import read_config_json
from services.engine.sampling.params import SamplingParams
from tests.services.engine.helpers import assert_pools_empty, drafter_config, randomize
from tests.services.engine.models.hf_models import VOCAB, hf_checkpoint

WINDOW = 24
NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(target folder, drafter folder, the transformers model)."""
    return windowed_pair(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=WINDOW)


def windowed_pair(root: Path, family: str, **overrides) -> tuple[Path, Path, object]:
    """(target folder, drafter folder, the transformers model): a random ``family`` target
    saved by transformers with ``overrides``, an ids-only tokenizer, a drafter of window 8."""
    model = hf_checkpoint(root / "target", family, seed=3, eos_token_id=None, bos_token_id=None, **overrides)
    vocab = {f"t{i}": i for i in range(VOCAB)}  # a tokenizer the folder must have; ids only
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(root / "target" / "tokenizer.json"))
    drafter = Eagle3Drafter(drafter_config(window=8, vocab=VOCAB))
    randomize(drafter, seed=4)
    save_model(drafter, root / "drafter", dtype=torch.float32)
    return root / "target", root / "drafter", model


def reference(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: else generate masks the ids equal to pad_token_id
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def engine(pair, chunk: int, k: int, pages: int = 256, **options) -> Engine:
    """An engine over ``pair`` (k = 0: the target alone) with ``pages`` pages per layer group;
    ``options``: more EngineConfig fields."""
    target, drafter, _ = pair
    groups = len(set(LlamaConfig.from_dict(read_config_json(target)).layer_windows())) + (k > 0)
    return Engine(
        EngineConfig(
            model=str(target),
            drafter=str(drafter) if k else None,
            num_spec_tokens=k,
            tokens_per_page=4,
            num_pages=(pages,) * groups,
            max_prefill_chunk=chunk,
            max_num_batched_tokens=max(chunk, 16),
            max_num_seqs=4,
            **options,
        )
    )


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def continuation_and_branch(e: Engine, model, first_len: int, cached_len: int, branch_at: int) -> list:
    """A request of ``first_len`` prompt tokens, then two more of 10 new tokens each: after
    the first ``cached_len`` tokens of its prompt and output, and after ``branch_at`` of
    them. Their outputs, whose tokens are checked against transformers' greedy ones."""
    first = prompt(first_len, seed=5)
    (out,) = e.generate([first], GREEDY)
    cached = (first + out.token_ids)[:cached_len]
    turn2, branch = cached + prompt(10, seed=6), cached[:branch_at] + prompt(10, seed=7)
    outputs = [e.generate([p], GREEDY)[0] for p in (turn2, branch)]
    assert [o.token_ids for o in outputs] == [reference(model, p) for p in (turn2, branch)]
    return outputs


@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("k", [0, 2])
def test_greedy_tokens_equal_transformers(mistral, chunk, k):
    e = engine(mistral, chunk, k)
    assert e.manager.groups["target"].window == WINDOW
    prompts = [prompt(80, seed=1), prompt(90, seed=2)]
    outputs = e.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [reference(mistral[2], p) for p in prompts]
    assert_pools_empty(e)


@pytest.mark.parametrize("k", [0, 2])
def test_a_continuation_hits_the_prefix_cache_and_a_branch_before_the_window_does_not(mistral, k):
    e = engine(mistral, 16, k)
    # the whole pages of the exact prefix: 80 + 23; the window at 90 reaches released pages
    outputs = continuation_and_branch(e, mistral[2], 80, 100, 90)
    hit = {"target": 100, "draft": 100} if k else {"target": 100}
    assert outputs[0].usage.cached_tokens == hit
    assert outputs[1].usage.cached_tokens == {g: 0 for g in hit}
    assert_pools_empty(e)


@pytest.mark.parametrize("k", [0, 2])
def test_a_context_longer_than_the_pool_is_served_within_the_window(mistral, k):
    e = engine(mistral, 8, k, pages=24)  # 96 tokens of pages for a 174-token context
    long = prompt(150, seed=8)
    (out,) = e.generate([long], GREEDY)
    assert out.token_ids == reference(mistral[2], long)
    assert_pools_empty(e)
