"""tandem.v1 services: their methods' shapes, and generated stubs serving over loopback gRPC."""

from concurrent import futures

import grpc
import pytest

from proto.tandem.v1 import (
    client_pb2,
    client_pb2_grpc,
    registration_pb2,
    registration_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.services.common.proto_samples import full_rank_info


@pytest.mark.parametrize(
    "module, service, method, streaming",
    [
        (client_pb2, "Tandem", "Generate", True),
        (client_pb2, "Tandem", "Abort", False),
        (client_pb2, "Tandem", "Health", False),
        (client_pb2, "Tandem", "ModelInfo", False),
        (registration_pb2, "Registration", "Register", False),
        (registration_pb2, "Registration", "Deregister", False),
        (registration_pb2, "Registration", "ListPeers", False),
        (registration_pb2, "Registration", "Heartbeat", False),
        (worker_pb2, "DecodeWorker", "Reserve", False),
        (worker_pb2, "DecodeWorker", "Renew", False),
        (worker_pb2, "DecodeWorker", "Release", False),
        (worker_pb2, "DecodeWorker", "Decode", True),
        (worker_pb2, "DecodeWorker", "Stats", False),
        (worker_pb2, "PrefillWorker", "Prefill", True),
        (worker_pb2, "PrefillWorker", "Stats", False),
    ],
)
def test_service_methods(module, service, method, streaming):
    descriptor = module.DESCRIPTOR.services_by_name[service].methods_by_name[method]
    assert (descriptor.server_streaming, descriptor.client_streaming) == (streaming, False)
    if service != "PrefillWorker" or method != "Stats":  # Stats pairs are shared by both workers
        assert descriptor.input_type.name == f"{method}Request"
        assert descriptor.output_type.name == f"{method}Response"


class _EchoTandem(client_pb2_grpc.TandemServicer):
    def Generate(self, request, context):
        for token_id in request.token_ids.ids:
            yield client_pb2.GenerateResponse(
                request_id=request.request_id, chunk=client_pb2.Chunk(token_ids=[token_id])
            )
        complete = client_pb2.Complete(
            finish_reason=client_pb2.FINISH_REASON_STOP,
            usage=client_pb2.Usage(completion_tokens=len(request.token_ids.ids)),
        )
        yield client_pb2.GenerateResponse(request_id=request.request_id, complete=complete)


class _RefusingRegistry(registration_pb2_grpc.RegistrationServicer):
    def Register(self, request, context):
        return registration_pb2.RegisterResponse(accepted=False, peer=request.rank_info)


def test_generated_stubs_serve_over_loopback():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    client_pb2_grpc.add_TandemServicer_to_server(_EchoTandem(), server)
    registration_pb2_grpc.add_RegistrationServicer_to_server(_RefusingRegistry(), server)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(worker_pb2_grpc.DecodeWorkerServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = client_pb2.GenerateRequest(request_id="r", token_ids=client_pb2.TokenIds(ids=[5, 6]))
            stream = list(client_pb2_grpc.TandemStub(channel).Generate(request, timeout=10))
            assert [r.WhichOneof("payload") for r in stream] == ["chunk", "chunk", "complete"]
            assert [list(r.chunk.token_ids) for r in stream[:2]] == [[5], [6]]
            assert stream[2].complete.usage.completion_tokens == 2
            registered = registration_pb2_grpc.RegistrationStub(channel).Register(
                registration_pb2.RegisterRequest(rank_info=full_rank_info()), timeout=10
            )
            assert registered.peer == full_rank_info() and not registered.accepted
            with pytest.raises(grpc.RpcError) as raised:
                worker_pb2_grpc.DecodeWorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)
            assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(grace=None)
