"""Pairing a prefill worker with a decode worker, driven by the router.

1. The decode worker checks the prefill worker's RankInfo (``Register``), connects its UCX
   endpoint to it (for acknowledgements) and waits for the test transfer.
2. The prefill worker checks the decode worker's RankInfo, connects, and runs the test
   transfer (a 64 KiB buffer sent and echoed over UCX).
A mismatch on either side refuses the pair, naming the field and both values; the pair
is READY only when both accepted and the test transfer came back intact.
"""

from __future__ import annotations

import grpc

from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from services.router.registry import PairState

PAIR_TIMEOUT_S = 30.0


def describe_mismatches(response: reg.RegisterResponse) -> str:
    return "; ".join(
        f"{m.field}: local {m.local_value} vs peer {m.peer_value}" + (f" ({m.reason})" if m.reason else "")
        for m in response.mismatches
    )


async def pair_workers(
    channels: dict[str, grpc.aio.Channel], prefill: rpb.RankInfo, decode: rpb.RankInfo, token: str = ""
) -> tuple[PairState, str]:
    """Run both registrations, decode side first. Returns the pair's state and why."""
    steps = ((decode, prefill), (prefill, decode))  # (who checks, whose info)
    for checker, peer in steps:
        stub = reg_grpc.RegistrationStub(channels[checker.instance_id])
        try:
            response = await stub.Register(
                reg.RegisterRequest(rank_info=peer, token=token), timeout=PAIR_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as e:
            return PairState.FAILED, f"{checker.instance_id}: {e.code().name}: {e.details()}"
        if not response.accepted:
            return (
                PairState.REFUSED,
                f"{checker.instance_id} refused {peer.instance_id}: {describe_mismatches(response)}",
            )
    return PairState.READY, ""
