"""On the GPU: mixture-of-experts targets (a random gpt-oss-shaped pair with attention sinks,
two target layer groups and the fused MoE kernel; a Qwen3-MoE folder saved by transformers)
decode the same tokens from CUDA graphs as eagerly, and float32 on the GPU as on the CPU."""

from __future__ import annotations

import pytest
import torch

from bench.random_model import build
from bench.random_shapes import PRESETS
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling.params import SamplingParams
from tests.services.engine.models.hf_models import MOE, hf_checkpoint
from tests.services.engine.tokenizer_helpers import trained_bpe, write_folder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(5, 45)), list(range(100, 103)), list(range(7, 80, 3))]  # past the 16-token window


@pytest.fixture(scope="module")
def gpt_oss_pair(tmp_path_factory):
    return build(tmp_path_factory.mktemp("moe"), PRESETS["tiny-moe"], shards=2, device="cpu")


def engine(target, drafter, device: str, dtype: str, eager: bool) -> Engine:
    return Engine(
        EngineConfig(
            model=str(target),
            drafter=str(drafter) if drafter else None,
            num_spec_tokens=3 if drafter else 0,
            device=device,
            dtype=dtype,
            max_num_seqs=4,
            enforce_eager=eager,
            kv_cache_bytes=64 << 20,
        )
    )


def tokens(e: Engine) -> list[list[int]]:
    return [o.token_ids for o in e.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("with_drafter", [False, True])
def test_gpt_oss_graphs_equal_eager(gpt_oss_pair, with_drafter):
    target, drafter = gpt_oss_pair
    drafter = drafter if with_drafter else None
    graphed = engine(target, drafter, "cuda", "bfloat16", eager=False)
    assert graphed.runner.graphs is not None
    assert tokens(graphed) == tokens(engine(target, drafter, "cuda", "bfloat16", eager=True))


def test_gpt_oss_float32_on_the_gpu_is_the_cpu(gpt_oss_pair):
    target, _ = gpt_oss_pair
    assert tokens(engine(target, None, "cuda", "float32", eager=True)) == tokens(
        engine(target, None, "cpu", "float32", eager=True)
    )


def test_qwen3_moe_graphs_equal_eager(tmp_path):
    tok = trained_bpe(300)
    hf_checkpoint(
        tmp_path, "qwen3_moe", **MOE["qwen3_moe"], vocab_size=tok.get_vocab_size(), num_hidden_layers=4
    )
    write_folder(tmp_path, tok)
    graphed = engine(tmp_path, None, "cuda", "bfloat16", eager=False)
    assert tokens(graphed) == tokens(engine(tmp_path, None, "cuda", "bfloat16", eager=True))
