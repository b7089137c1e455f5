"""Moving KV pages between worker processes: the names the services use.

- :class:`TransferAgent` moves a request's pages, aux state and ack between two workers
  of any TP sizes, and holds the pairing side channel (:class:`PairingMessage` kinds);
- a TP worker's other ranks each run a :class:`RankTransfer` over their own pools;
  rank 0 reaches them through the services' :class:`RankLinks`
  with :class:`SendJob`, :class:`RecvJob` and :class:`LinkTest`;
- :func:`heads_of_rank` is the KV-head split both the transfer and the model sharding use.

Everything else in this package (the UCX transport, tags, page runs) is its own.
"""

from kvcore import AuxState
from kvcore.transfer.agent import TransferAgent
from kvcore.transfer.fanout import RankLinks
from kvcore.transfer.head_routes import HeadRoute, heads_of_rank
from kvcore.transfer.jobs import LinkTest, PeerRank, RecvJob, SendJob, TransferUsage
from kvcore.transfer.rank import RankTransfer
from kvcore.transfer.side_channel import PairingMessage
from kvcore.transfer.ucx import EndpointInfo, TransferError, TransferTimeout

__all__ = [
    "AuxState",
    "EndpointInfo",
    "HeadRoute",
    "LinkTest",
    "PairingMessage",
    "PeerRank",
    "RankLinks",
    "RankTransfer",
    "RecvJob",
    "SendJob",
    "TransferAgent",
    "TransferError",
    "TransferTimeout",
    "TransferUsage",
    "heads_of_rank",
]
