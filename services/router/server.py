"""The router's gRPC services: tandem.v1.Tandem (clients) and tandem.v1.Registration
(workers), each a thin translation onto ``RouterAPI`` (api.py).

Invariants:
- A servicer holds no state of its own: every answer comes from the RouterAPI.
- A ``RouterError`` ends the RPC with the gRPC status of its code and its message as the
  details; a client request that does not decode ends with INVALID_ARGUMENT
  (grpc_decode.py); nothing else is translated.
"""

from __future__ import annotations

import grpc

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import registration_pb2 as reg
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from services.common.access import caller_identity, client_owner
from services.common.grpc_server import write_stream
from services.router.api import RouterAPI
from services.router.errors import ErrorCode, RouterError
from services.router.grpc_decode import add_checked
from services.router.registration import Registration

STATUS = {code: grpc.StatusCode[code.name] for code in ErrorCode}


class TandemServicer(cpb_grpc.TandemServicer):
    """The client API."""

    def __init__(self, api: RouterAPI) -> None:
        self.api = api

    async def Generate(self, request: cpb.GenerateRequest, context) -> None:
        """Messages are written, not yielded, so a client's cancel lands inside this
        coroutine and the request's cleanup runs at once."""
        try:
            await write_stream(self.api.generate(request, client_owner(context)), context)
        except RouterError as e:
            await _abort(context, e)

    async def Abort(self, request: cpb.AbortRequest, context) -> cpb.AbortResponse:
        """Only the client that started a request may abort it (``client_owner``)."""
        return cpb.AbortResponse(found=await self.api.abort(request.request_id, client_owner(context)))

    async def Health(self, request: cpb.HealthRequest, context) -> cpb.HealthResponse:
        return await self.api.health()

    async def ModelInfo(self, request: cpb.ModelInfoRequest, context) -> cpb.ModelInfoResponse:
        return await self.api.model_info()


class RegistrationServicer(reg_grpc.RegistrationServicer):
    """The workers' registry."""

    def __init__(self, registration: Registration) -> None:
        self.registration = registration

    async def Register(self, request: reg.RegisterRequest, context) -> reg.RegisterResponse:
        try:
            return await self.registration.register(request, caller_identity())
        except RouterError as e:
            await _abort(context, e)

    async def Deregister(self, request: reg.DeregisterRequest, context) -> reg.DeregisterResponse:
        try:
            removed = await self.registration.deregister(
                request.instance_id, caller_identity(), request.draining
            )
        except RouterError as e:
            await _abort(context, e)
        return reg.DeregisterResponse(removed=removed)

    async def ListPeers(self, request: reg.ListPeersRequest, context) -> reg.ListPeersResponse:
        return reg.ListPeersResponse(peers=self.registration.list_peers(request.role))

    async def Heartbeat(self, request: reg.HeartbeatRequest, context) -> reg.HeartbeatResponse:
        try:
            return self.registration.heartbeat(request.instance_id, caller_identity())
        except RouterError as e:
            await _abort(context, e)


def add_router_servicers(server: grpc.aio.Server, api: RouterAPI) -> None:
    """Serve ``api`` as tandem.v1.Tandem and tandem.v1.Registration on ``server``."""
    add_checked(cpb_grpc.add_TandemServicer_to_server, TandemServicer(api), server)
    reg_grpc.add_RegistrationServicer_to_server(RegistrationServicer(api.registration), server)


async def _abort(context: grpc.aio.ServicerContext, error: RouterError) -> None:
    await context.abort(STATUS[error.code], error.message)
