"""Request checks. Every refusal is a ValueError naming the field."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from kvcore import KVCacheManager, Owner
from kvcore.spec import cdiv
from services.engine.models import TargetConfig
from services.engine.sampling.params import SamplingParams
from services.tokenization.tokenizer import Tokenizer


def eos_ids(model_dir: str, config: TargetConfig, tokenizer: Tokenizer) -> frozenset[int]:
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
    if not set(map(type, ids)) <= {int, bool} or not 0 <= min(ids) <= max(ids) < vocab:  # C loops
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
    return ids


def check_spec_tokens(num_spec_tokens: int | None, k: int) -> int:
    """A request's drafts per step: None = the engine's K; else 0..K."""
    if num_spec_tokens is None:
        return k
    if (
        isinstance(num_spec_tokens, bool)
        or not isinstance(num_spec_tokens, int)
        or not 0 <= num_spec_tokens <= k
    ):
        raise ValueError(
            f"num_spec_tokens: must be an integer in [0, {k}] (the server's K), got {num_spec_tokens!r}"
        )
    return num_spec_tokens


class RequestExists(ValueError):
    """A request id the engine already holds pages or state for."""


def check_prompt_len(prompt_len: int, max_model_len: int) -> None:
    """A reserved prompt has at least one token and leaves room for output."""
    if prompt_len < 1:
        raise ValueError("prompt_len: must be >= 1")
    if prompt_len >= max_model_len:
        raise ValueError(f"prompt_len: {prompt_len} leaves no room in the context of {max_model_len}")


def check_prompt_ids(prompt_ids: Sequence[int], prompt_len: int, vocab: int) -> None:
    """Reserved prompt tokens (optional: empty) number ``prompt_len`` and lie in the vocabulary."""
    if prompt_ids and len(prompt_ids) != prompt_len:
        raise ValueError(f"prompt_token_ids: {len(prompt_ids)} tokens, prompt_len is {prompt_len}")
    if any(t >= vocab for t in prompt_ids):
        raise ValueError(f"prompt_token_ids: {max(prompt_ids)} is outside the vocabulary of {vocab}")


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
        need, total = cdiv(tokens, manager.tokens_per_page), manager.num_pages(name)
        if need > total:
            raise ValueError(f"prompt: needs {need} KV pages of group {name}, the cache holds {total}")


def check_context_fits(max_model_len: int, manager: KVCacheManager) -> None:
    """One request of ``max_model_len`` tokens (prompt plus completion) fits an otherwise
    empty cache, in every layer group: ValueError naming max_model_len, with the longest
    that fits, when it does not."""
    longest = longest_fitting(manager)
    if max_model_len > longest:
        raise ValueError(
            f"max_model_len: {max_model_len} tokens do not fit the KV cache: it holds one request "
            f"of at most {longest} tokens ({_page_counts(manager)}, {manager.config.headroom_tokens} "
            "tokens of headroom); lower --max-model-len or give the KV cache more memory "
            "(--gpu-memory-utilization, --kv-cache-mb)"
        )


def longest_fitting(manager: KVCacheManager) -> int:
    """The longest request (prompt plus completion, tokens) that :func:`check_fits` takes
    into an empty cache: every full-attention group's pages less the headroom; a windowed
    group bounds it only when it cannot hold its window's span."""
    p, headroom = manager.tokens_per_page, manager.config.headroom_tokens
    longest = []
    for name, spec in manager.groups.items():
        pages = manager.num_pages(name)
        if spec.window > 0 and cdiv(_window_tokens(name, manager), p) <= pages:
            continue  # holds what any length needs at once
        longest.append(pages * p - headroom)
    return max(0, min(longest, default=1 << 62))


def _page_counts(manager: KVCacheManager) -> str:
    return ", ".join(f"{manager.num_pages(g)} pages of group {g}" for g in manager.groups)


def _window_tokens(group: str, manager: KVCacheManager) -> int:
    """Most positions of a windowed group one request holds at once: its window (plus one
    for a target feeding a drafter), the longer of a prefill chunk and, for a target group,
    the span a prefix hit re-runs to refill a windowed drafter (L * (W - 1) + 1), the
    headroom twice (verify positions not yet final, and the pages ahead), and three pages
    of misalignment."""
    c, spec = manager.config, manager.groups[group]
    span = c.max_prefill_chunk
    if spec.owner == Owner.TARGET:
        drafts = [g for g in c.groups if g.owner == Owner.DRAFT and g.window]
        span = max([span, *(g.num_layers * (g.window - 1) + 2 for g in drafts)])
    return spec.window + 1 + span + 2 * c.headroom_tokens + 3 * manager.tokens_per_page
