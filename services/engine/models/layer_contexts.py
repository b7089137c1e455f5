"""The KV contexts of one forward, one per layer group of the model that runs it.

A model whose layers form several layer groups (a per-layer window mix: full-attention
layers in one group, sliding ones in another) attends each layer through its group's
context: each group has its own pool, window and block-table rows. Layer ``layer_ids[j]``
of a group is the group's layer j: its index in the group's pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.engine.models.attention import DenseContext, KVContext


class NamedLayers(Protocol):
    """A layer group's name and the model's layers in it (a ``KVLayerGroup``, or a graphed
    forward's group)."""

    name: str
    layer_ids: tuple[int, ...]


class WindowedLayers(NamedLayers, Protocol):
    """A named layer group with its attention window (a ``KVLayerGroup``): 0 = none."""

    window: int


@dataclass(frozen=True, slots=True)
class GroupContext:
    """One layer group's context: ``layer_ids`` are the model's (global) layer ids of the
    group, in the order of its pool's layers."""

    name: str
    layer_ids: tuple[int, ...]
    ctx: KVContext


class LayerContexts:
    """Per layer of a model, the context it attends through and its index there.

    Invariant: every layer of the model is in exactly one group (a layer outside them all
    raises KeyError naming it)."""

    __slots__ = ("_route", "groups")

    def __init__(self, groups: Sequence[GroupContext]) -> None:
        self.groups = tuple(groups)
        self._route = {layer: (g.ctx, j) for g in self.groups for j, layer in enumerate(g.layer_ids)}
        if len(self._route) != sum(len(g.layer_ids) for g in self.groups):
            raise ValueError(f"groups: a layer is in two groups: {[g.layer_ids for g in self.groups]}")

    def at(self, layer: int) -> tuple[KVContext, int]:
        """(the context of ``layer``'s group, its index in that group's pool)."""
        if layer not in self._route:
            raise KeyError(f"layer {layer} is in none of the groups {[g.name for g in self.groups]}")
        return self._route[layer]

    def only(self) -> KVContext:
        """The context of a forward over one layer group (the drafter's)."""
        if len(self.groups) != 1:
            raise ValueError(f"groups: expected one layer group, got {[g.name for g in self.groups]}")
        return self.groups[0].ctx


def layer_contexts(groups: Sequence[NamedLayers], contexts: Sequence[KVContext]) -> LayerContexts:
    """``contexts[i]`` for the layers of ``groups[i]``."""
    return LayerContexts(
        [GroupContext(g.name, g.layer_ids, ctx) for g, ctx in zip(groups, contexts, strict=True)]
    )


def dense_contexts(groups: Sequence[WindowedLayers], batch: int, seq_len: int) -> LayerContexts:
    """Dense contexts (training, reference runs) of ``batch`` rows of ``seq_len`` positions:
    one per group, with the group's window."""
    return layer_contexts(groups, [DenseContext(batch, seq_len, window=g.window) for g in groups])
