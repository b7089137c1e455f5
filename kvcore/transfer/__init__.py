"""Moving KV pages between worker processes: the names the services use.

- :class:`TransferAgent` moves a request's pages, aux state and ack between two workers
  of any TP sizes, and holds the pairing side channel (:class:`PairingMessage` kinds);
  a sender names each request's receiver by a checked :class:`TransferTarget`;
- a TP worker's other ranks each run a :class:`RankTransfer` over their own pools;
  rank 0 reaches them through the services' :class:`RankLinks`
  with :class:`SendJob`, :class:`RecvJob` and :class:`LinkTest`;
- every rank publishes its transport's :class:`EndpointInfo`, which names its backend
  (:data:`BACKENDS`, :func:`new_transport`); the transports behind it are
  :class:`Transport`\\ s, and their failures :class:`TransferError`\\ s;
- :func:`heads_of_rank` is the KV-head split both the transfer and the model sharding use;
- :func:`yield_while` tells the process's transfers when another thread wants the GIL, so
  that their waits give it up (:mod:`kvcore.transfer.pacing`).

Everything else in this package (the UCX backend, tags, page runs) is its own.
"""

from kvcore import AuxState
from kvcore.transfer.agent import TransferAgent
from kvcore.transfer.backends import BACKENDS, DEFAULT_BACKEND, new_transport
from kvcore.transfer.endpoint import EndpointInfo
from kvcore.transfer.errors import TransferError, TransferTimeout, TransportClosed
from kvcore.transfer.fanout import RankLinks
from kvcore.transfer.head_routes import HeadRoute, heads_of_rank
from kvcore.transfer.jobs import LinkTest, PeerRank, RecvJob, SendJob, TransferUsage
from kvcore.transfer.pacing import yield_while
from kvcore.transfer.rank import RankTransfer
from kvcore.transfer.side_channel import PairingMessage
from kvcore.transfer.target import ReservedGroup, TransferTarget
from kvcore.transfer.transport import Transport

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "AuxState",
    "EndpointInfo",
    "HeadRoute",
    "LinkTest",
    "PairingMessage",
    "PeerRank",
    "RankLinks",
    "RankTransfer",
    "RecvJob",
    "ReservedGroup",
    "SendJob",
    "TransferAgent",
    "TransferError",
    "TransferTarget",
    "TransferTimeout",
    "TransferUsage",
    "Transport",
    "TransportClosed",
    "heads_of_rank",
    "new_transport",
    "yield_while",
]
