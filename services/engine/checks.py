"""Engine setup and request checks. Every refusal is a ValueError naming the field."""

from __future__ import annotations

import json
import os

from kvcore import CacheConfig, KVCacheManager, LayerGroupSpec, Lifecycle, Owner
from kvcore.spec import cdiv
from services.engine.config import EngineConfig
from services.engine.models import Eagle3Drafter, LlamaConfig, LlamaForCausalLM
from services.engine.runner import DRAFT_GROUP, TARGET_GROUP
from services.engine.sampling import SamplingParams
from tokenization.tokenizer import Tokenizer


def cache_config(
    c: EngineConfig, target: LlamaForCausalLM, drafter: Eagle3Drafter | None, k: int
) -> CacheConfig:
    """The target group (windowed by the model's ``sliding_window``), plus the drafter's
    (OPTIONAL, windowed) group when it runs."""
    t = target.config
    groups = [
        LayerGroupSpec(
            TARGET_GROUP,
            Owner.TARGET,
            t.num_hidden_layers,
            t.num_key_value_heads,
            t.head_dim,
            dtype=c.dtype,
            window=t.sliding_window,
        )
    ]
    if drafter is not None:
        d = drafter.config
        groups.append(
            LayerGroupSpec(
                DRAFT_GROUP,
                Owner.DRAFT,
                d.num_hidden_layers,
                d.num_key_value_heads,
                d.head_dim,
                dtype=c.dtype,
                window=d.sliding_window,
                lifecycle=Lifecycle.OPTIONAL,
            )
        )
    host_pages = c.host_kv_cache_bytes // sum(g.page_bytes(c.tokens_per_page) for g in groups)
    return CacheConfig(
        groups=tuple(groups),
        tokens_per_page=c.tokens_per_page,
        num_pages=tuple(c.num_pages[: len(groups)]),
        memory_bytes=c.kv_cache_bytes,
        max_num_seqs=c.max_num_seqs,
        max_prefill_chunk=c.max_prefill_chunk,
        num_spec_tokens=k,
        draft_block_width=1,
        layout=c.layout,
        enable_prefix_cache=c.enable_prefix_cache,
        host_num_pages=host_pages,
        host_write_policy=c.host_kv_write_policy,
        host_recall_min_pages=c.host_kv_recall_min_pages,
    )


def eos_ids(model_dir: str, config: LlamaConfig, tokenizer: Tokenizer) -> frozenset[int]:
    """The union of config.json's and generation_config.json's ``eos_token_id`` (an int
    or a list, as Llama 3 ships); else the tokenizer's eos token; else none."""
    ids = set(_id_list(config.eos_token_id, "config.json"))
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            ids.update(_id_list(json.load(f).get("eos_token_id"), "generation_config.json"))
    if not ids and tokenizer.eos_id is not None:
        ids.add(tokenizer.eos_id)
    return frozenset(ids)


def _id_list(value, where: str) -> list[int]:
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{where}: eos_token_id: expected an id or a list of ids, got {value!r}")
    return ids


def check_sampling(sampling: SamplingParams | None) -> SamplingParams:
    if sampling is None:
        return SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
    return sampling


def encode_prompt(prompt: str | list[int], tokenizer: Tokenizer, vocab: int) -> list[int]:
    """Text is encoded by the model's tokenizer (with its special tokens, e.g. BOS);
    token ids must lie in [0, vocab)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: must not be empty")
        ids = tokenizer.encode(prompt)
        if max(ids, default=0) >= vocab:
            raise ValueError(
                f"prompt: the tokenizer gave id {max(ids)}, outside the model's vocabulary [0, {vocab})"
            )
        return ids
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt: must not be empty")
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
    return ids


def check_fits(prompt_len: int, max_tokens: int, max_model_len: int, manager: KVCacheManager) -> None:
    """The request fits the context, and an otherwise empty cache."""
    if prompt_len >= max_model_len:
        raise ValueError(f"prompt: {prompt_len} tokens leave no room in the context of {max_model_len}")
    if prompt_len + max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens: {prompt_len} prompt tokens + {max_tokens} exceed the context of {max_model_len}"
        )
    full = prompt_len + max_tokens + manager.config.headroom_tokens
    for name, spec in manager.groups.items():
        tokens = min(full, _window_tokens(name, manager)) if spec.window > 0 else full
        need, total = cdiv(tokens, manager.page), manager.allocators[name].num_pages
        if need > total:
            raise ValueError(f"prompt: needs {need} KV pages of group {name}, the cache holds {total}")


def _window_tokens(group: str, manager: KVCacheManager) -> int:
    """Most positions of a windowed group one request holds at once: its window (plus one
    for a target feeding a drafter), the longer of a prefill chunk and, for the target,
    the span a prefix hit re-runs to refill a windowed drafter (L * (W - 1) + 1), the
    headroom twice (verify positions not yet final, and the pages ahead), and three pages
    of misalignment."""
    c, spec = manager.config, manager.groups[group]
    span = c.max_prefill_chunk
    if group == c.groups[0].name:
        span = max([span, *(g.num_layers * (g.window - 1) + 2 for g in c.groups[1:] if g.window)])
    return spec.window + 1 + span + 2 * c.headroom_tokens + 3 * manager.page
