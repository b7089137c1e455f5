"""Where one request's pages go: the receiver's reservation, as a sender needs it.

A prefill worker builds one :class:`TransferTarget` per request from the decode worker's
reservation (:meth:`TransferTarget.of` checks it, naming the bad field) and hands it to
:meth:`~kvcore.transfer.agent.TransferAgent.send_to`. Invariants of a built target:

- every group's held entries fit its block-table row;
- ``tag`` is 0 (the request's own base tag) or a base tag: its group and chunk bits zero;
- ``endpoint``, when the reservation names one, is the receiver's rank 0 as it published it;
  an agent refuses a target whose endpoint names another backend than its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcore.transfer.endpoint import EndpointInfo
from kvcore.transfer.tags import CHUNK_BITS, GROUP_BITS, is_base_tag

ReservedGroup = tuple[str, Sequence[int], int]
"""One group of a reservation: (group name, the receiver's block-table row, leading entries
of it the receiver holds already)."""


@dataclass(frozen=True, slots=True)
class TransferTarget:
    """One request's receiver, checked (the module's invariants)."""

    peer_id: str  # the receiving worker, a paired peer (the agent knows its ranks)
    dest: dict[str, list[int]]  # per group, the receiver's block-table row; -1 = no page there
    held: dict[str, int]  # per group, leading entries the receiver holds already: not sent
    tag: int = 0  # the reservation's base tag; 0 = request_tag(request_id)
    endpoint: EndpointInfo | None = None  # the receiver's rank 0; None = the reservation names none

    @classmethod
    def of(
        cls,
        peer_id: str,
        groups: Sequence[ReservedGroup],
        tag: int = 0,
        endpoint: EndpointInfo | None = None,
    ) -> TransferTarget:
        """The target of a reservation of ``groups``, in its order. ValueError naming the
        first bad field: ``peer_id``, ``groups[i].num_held``, ``transfer_tag``."""
        if not peer_id:
            raise ValueError("peer_id: empty")
        for i, (_, row, num_held) in enumerate(groups):
            if num_held > len(row):
                raise ValueError(f"groups[{i}].num_held: {num_held} of {len(row)} pages")
        if not is_base_tag(tag):
            raise ValueError(f"transfer_tag: {tag:#x} has its low {GROUP_BITS + CHUNK_BITS} bits set")
        dest = {name: list(row) for name, row, _ in groups}
        held = {name: num_held for name, _, num_held in groups}
        return cls(peer_id, dest, held, tag, endpoint)
