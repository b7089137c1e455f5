"""What each worker role serves: role name -> the function adding its gRPC servicers,
which the entry points pass to ``run_worker`` (services/worker/serve.py).

- prefill: tandem.v1.PrefillWorker;
- decode: tandem.v1.DecodeWorker, and tandem.v1.WorkerStreams for its chunks;
- both (aggregated): tandem.v1.Tandem, which the router forwards requests to, the
  PrefillWorker service for its Stats, and tandem.v1.WorkerStreams for its chunks.
"""

from __future__ import annotations

import grpc

from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.aggregated.server import AggregatedServicer, AggregatedStats
from services.decode.server import DecodeServicer
from services.prefill.server import PrefillServicer
from services.worker.peering import PeerRegistry
from services.worker.serve import AddServicers
from services.worker.step_streams import StepStreams
from services.worker.worker import WorkerBase


def add_prefill(server: grpc.aio.Server, worker: WorkerBase, peers: PeerRegistry) -> None:
    wpb_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(worker, peers), server)


def add_decode(server: grpc.aio.Server, worker: WorkerBase, peers: PeerRegistry) -> None:
    steps = StepStreams()
    wpb_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(worker, steps), server)
    wpb_grpc.add_WorkerStreamsServicer_to_server(steps, server)


def add_aggregated(server: grpc.aio.Server, worker: WorkerBase, peers: PeerRegistry) -> None:
    steps = StepStreams()
    cpb_grpc.add_TandemServicer_to_server(AggregatedServicer(worker, steps), server)
    wpb_grpc.add_WorkerStreamsServicer_to_server(steps, server)
    wpb_grpc.add_PrefillWorkerServicer_to_server(AggregatedStats(worker), server)


WORKER_ROLES: dict[str, AddServicers] = {
    "prefill": add_prefill,
    "decode": add_decode,
    "both": add_aggregated,
}
