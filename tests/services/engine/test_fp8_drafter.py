"""``draft_quantization="fp8"``: the drafter's own weights in e4m3. Verification stays in
the target's dtype, so greedy output is target-only's token for token; the trained pair
still drafts well."""

from __future__ import annotations

import pytest

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.models.fp8 import Fp8Linear
from services.engine.sampling.params import SamplingParams
from tests.services.engine.helpers import WINDOW, assert_pools_empty, make_engine, random_prompts
from tests.services.engine.test_lossless import TINY, held_out_snippets

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_fp8_drafter_is_lossless(pair):
    prompts = random_prompts(12, seed=2, max_len=4 * WINDOW)
    reference = [o.token_ids for o in make_engine(pair, k=0).generate(prompts, GREEDY)]
    engine = make_engine(pair, k=3, draft_quantization="fp8")
    assert isinstance(engine.drafter.fc, Fp8Linear)
    assert isinstance(engine.drafter.midlayer.mlp.down_proj, Fp8Linear)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == reference
    assert_pools_empty(engine)


def test_the_trained_pair_drafts_as_well_in_fp8():
    prompts = held_out_snippets(16, seed=4)
    common = dict(
        model=str(TINY / "tiny-target"),
        drafter=str(TINY / "tiny-drafter"),
        num_spec_tokens=4,
        num_pages=(512, 256),
        max_num_batched_tokens=2048,
    )
    full = Engine(EngineConfig(**common))
    fp8 = Engine(EngineConfig(draft_quantization="fp8", **common))
    assert [o.token_ids for o in fp8.generate(prompts, GREEDY)] == [
        o.token_ids for o in full.generate(prompts, GREEDY)
    ]
    al, al_fp8 = full.stats["local"].acceptance_length, fp8.stats["local"].acceptance_length
    assert al > 2.0 and abs(al_fp8 - al) < 0.1 * al, (al, al_fp8)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"draft_quantization": "int4"}, "draft_quantization: must be one of"),
        (
            {"draft_quantization": "fp8", "num_spec_tokens": 0},
            "draft_quantization: fp8 quantizes the drafter",
        ),
    ],
)
def test_config_refuses_what_it_cannot_quantize(pair, options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(pair[0]), drafter=str(pair[1]), **options)
