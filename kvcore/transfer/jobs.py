"""What one rank of a worker is asked to do for a transfer, and what it reports back.

Rank 0's :class:`~kvcore.transfer.agent.TransferAgent` plans each request as jobs:

- a :class:`SendJob` per (sender rank, receiver rank) pair that shares heads;
- a :class:`RecvJob` per receiver rank, naming every sender rank it gathers from;
- a :class:`LinkTest` per rank pair that will exchange pages, at pairing.

Each rank runs its jobs with its own transport and pools
(:class:`~kvcore.transfer.rank.RankTransfer`). Page ids are rank 0's: every rank's pools
mirror its page decisions. Jobs are plain data: rank 0 runs its own in-process, the
services carry the others' to ranks 1.. (:class:`~kvcore.transfer.fanout.RankLinks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcore import TransferPages
from kvcore.transfer.endpoint import EndpointInfo
from kvcore.transfer.head_routes import HeadRoute


@dataclass(slots=True)
class TransferUsage:
    """Per group of one request's transfer.

    - ``bytes``: bytes moved, summed over ranks;
    - ``seconds``: wall time of the group's messages, the slowest rank's;
    - ``pages``: pages sent (once, not once per rank);
    - ``held``: leading pages not sent because the receiver held them.
    """

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    pages: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def add(self, part: TransferUsage) -> TransferUsage:
        """Fold one rank's (or one source's) usage in: bytes add up, seconds are the
        slowest one's. Returns self."""
        for group, n in part.bytes.items():
            self.bytes[group] = self.bytes.get(group, 0) + n
        for group, s in part.seconds.items():
            self.seconds[group] = max(self.seconds.get(group, 0.0), s)
        return self


@dataclass(frozen=True, slots=True)
class PeerRank:
    """One rank of a paired worker: the id its messages go to, and how to reach it."""

    instance_id: str  # rank 0 carries the worker's id
    endpoint: EndpointInfo


@dataclass(frozen=True, slots=True)
class SendJob:
    """Send rank ``src_rank``'s heads of ``pages`` to the peer rank ``peer_id``.

    - ``routes``: per group, the one route to that receiver; other groups are not sent;
    - ``dest``: the receiver's block-table rows, so runs contiguous on both sides move
      pool to pool; None packs each group into one message.
    """

    request_id: str
    peer_id: str
    src_rank: int
    pages: dict[str, TransferPages]
    routes: dict[str, HeadRoute]
    timeout_s: float
    dest: dict[str, list[int]] | None = None
    tag: int = 0  # the transfer's base tag (the reservation's); 0 = request_tag(request_id)


@dataclass(frozen=True, slots=True)
class RecvJob:
    """Receive this rank's heads of ``pages`` from every sender rank in ``sources``
    (sender rank -> its routes to this rank), one sender after the other."""

    request_id: str
    pages: dict[str, TransferPages]
    sources: dict[int, dict[str, HeadRoute]]
    timeout_s: float
    tag: int = 0  # the transfer's base tag (the reservation's); 0 = request_tag(request_id)


@dataclass(frozen=True, slots=True)
class TransferKey:
    """One transfer of a request: its id (which pages) and its base tag (which messages),
    fresh per reservation, so a retried request's messages never match an earlier attempt's."""

    request_id: str
    tag: int


@dataclass(frozen=True, slots=True)
class LinkTest:
    """The pairing test transfer with one peer rank: connect to it (replacing an
    endpoint a re-registered peer left stale), then ping it (``lead``) or echo its ping."""

    peer: PeerRank
    nonce: str
    lead: bool
