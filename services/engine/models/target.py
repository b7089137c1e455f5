"""What the engine needs of a target model: :class:`TargetModel`, and the KV layer groups a
model declares (:class:`KVLayerGroup`), from which the engine builds its KV cache.

A target's layers form one or more layer groups: layers that share KV geometry and an
attention window. Each group gets its own pool and block-table rows in kvcore; a model with
a per-layer window mix declares two (full attention, and the sliding layers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvcore import TARGET_GROUP

if TYPE_CHECKING:
    from services.engine.models.attention import KVContext
    from services.engine.models.layer_contexts import LayerContexts

TARGET_SLIDING_GROUP = "target_sliding"
"""Name of a target's sliding-window layer group beside its full-attention one."""


@dataclass(slots=True)
class TargetOutput:
    hidden: torch.Tensor  # [num_tokens, hidden_size], after the final norm
    aux: torch.Tensor | None  # [num_tokens, len(aux_layer_ids) * hidden_size], or None


@dataclass(frozen=True, slots=True)
class KVLayerGroup:
    """Layers of a target that share KV geometry and window: one kvcore layer group.
    ``layer_ids`` are the model's layer ids (ascending: the order of the group's pool);
    ``num_kv_heads`` counts the whole layer's heads, before tensor parallelism."""

    name: str
    layer_ids: tuple[int, ...]
    window: int  # tokens; 0 = full attention
    num_kv_heads: int
    head_dim: int


class TargetConfig(Protocol):
    """The config fields the engine reads of any target."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_id: int | list[int] | None


# (input_ids [num_tokens], positions [num_tokens], ctx, aux_layer_ids) -> the final-normed
# hidden states and the listed layers' outputs, concatenated
TargetForward = Callable[
    [torch.Tensor, torch.Tensor, "KVContext | LayerContexts", tuple[int, ...]], TargetOutput
]


class TargetModel(Protocol):
    """A target the engine serves. ``forward`` (called as ``model(...)``) attends through
    ``ctx``: one context for a model of one layer group, else one per group
    (:class:`~services.engine.models.layer_contexts.LayerContexts`); ``aux_layer_ids``
    defaults to ()."""

    config: Any  # a TargetConfig, and whatever the model's own file reads
    forward: TargetForward
    __call__: TargetForward

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [n] -> [n, hidden_size]."""
        ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] (final-normed) -> [n, vocab_size] logits in the model's
        dtype (float32 logits: ``.float()`` of these, exactly)."""
        ...

    def kv_layer_groups(self) -> tuple[KVLayerGroup, ...]:
        """The model's layer groups, every layer in exactly one; the first is named
        ``TARGET_GROUP``."""
        ...

    def merge_projections(self) -> None: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...


def layer_groups_by_window(
    windows: Sequence[int], num_kv_heads: int, head_dim: int
) -> tuple[KVLayerGroup, ...]:
    """The groups of layers whose windows are ``windows[i]`` (tokens, 0 = full): one per
    distinct window, full attention first. The first is ``TARGET_GROUP`` whatever its
    window (a model of one group: Mistral's windowed one too), the other
    ``TARGET_SLIDING_GROUP``."""
    distinct = sorted(set(windows))
    names = (TARGET_GROUP, TARGET_SLIDING_GROUP)
    if len(distinct) > len(names):
        raise ValueError(f"layer windows: {distinct} is more than a full and a sliding group")
    layers_of = lambda window: tuple(i for i, w in enumerate(windows) if w == window)
    return tuple(
        KVLayerGroup(name, layers_of(window), window, num_kv_heads, head_dim)
        for name, window in zip(names, distinct, strict=False)
    )


def model_dtype(model: TargetModel) -> torch.dtype:
    """The dtype of the model's weights, which its hidden states and logits have."""
    return next(model.parameters()).dtype
