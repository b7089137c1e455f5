"""kvcore.transfer's plain values as the protos carry them, and back: a rank's endpoint
(``RankInfo.transfer_endpoint``, ``Reservation.endpoint``) and a reservation as the
sender's :class:`~kvcore.transfer.TransferTarget`."""

from __future__ import annotations

from kvcore.transfer import EndpointInfo, TransferTarget
from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import worker_pb2 as wpb


def endpoint_to_proto(info: EndpointInfo) -> rpb.TransferEndpoint:
    return rpb.TransferEndpoint(backend=info.backend, address=info.address, host=info.host, port=info.port)


def endpoint_from_proto(message: rpb.TransferEndpoint) -> EndpointInfo:
    return EndpointInfo(message.backend, message.address, message.host, message.port)


def endpoint_of(info: rpb.RankInfo) -> EndpointInfo:
    """How a rank's RankInfo says it is reached."""
    return endpoint_from_proto(info.transfer_endpoint)


def target_of(reservation: wpb.Reservation) -> TransferTarget:
    """Where the pages of ``reservation``'s request go. ValueError naming the first bad field
    of the reservation (``decode_instance_id``, ``groups``, ``groups[i].num_held``,
    ``transfer_tag``)."""
    if not reservation.decode_instance_id:
        raise ValueError("decode_instance_id: empty")
    if not reservation.groups:
        raise ValueError("groups: empty")
    groups = [(g.group, g.page_ids, g.num_held) for g in reservation.groups]
    endpoint = endpoint_from_proto(reservation.endpoint) if reservation.HasField("endpoint") else None
    return TransferTarget.of(reservation.decode_instance_id, groups, reservation.transfer_tag, endpoint)
