"""``tandem generate --endpoint HOST:PORT``: one request to a running router over gRPC, its
text streamed to the terminal as it comes (``--json``: one JSON object at the end, with the
keys the offline mode prints). Loads no torch."""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from deploy.cli_flags import add_client_token_arg
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from services.common.security import TlsConfig

TIMEOUT_S = 600.0  # the whole request's deadline


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default="", help="a running router's gRPC host:port (instead of --offline)")
    add_client_token_arg(p, "the router's client token, if it takes one")
    p.add_argument(
        "--tls-cert", default="", help="PEM client certificate (OU=client) for a mutual-TLS router"
    )
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default="", help="PEM CA that signs the router's certificate")
    p.add_argument("--tls-server-name", default="", help="the name the router's certificate carries")


def request_of(args: argparse.Namespace) -> cpb.GenerateRequest:
    """The GenerateRequest of the generate flags (the prompt as text: the router tokenizes it)."""
    sampling = cpb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    if args.seed is not None:
        sampling.seed = args.seed
    request = cpb.GenerateRequest(text=args.prompt, sampling=sampling)
    if args.no_spec:
        request.speculative.num_spec_tokens = 0
    return request


def channel_to(endpoint: str, tls: TlsConfig | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(endpoint)
    return grpc.secure_channel(endpoint, tls.channel_credentials(), tls.channel_options())


def run_remote(args: argparse.Namespace, tls: TlsConfig | None, token: str) -> int:
    """Stream one completion from the router; 0 on success, 2 for a refused request
    (INVALID_ARGUMENT), 1 for any other failure, named on stderr."""
    metadata = [("authorization", f"Bearer {token}")] if token else []
    text, token_ids, complete = [], [], None
    try:
        with channel_to(args.endpoint, tls) as channel:
            stream = cpb_grpc.TandemStub(channel).Generate(
                request_of(args), metadata=metadata, timeout=TIMEOUT_S
            )
            for message in stream:
                kind = message.WhichOneof("payload")
                if kind == "chunk":
                    token_ids += message.chunk.token_ids
                    text.append(message.chunk.text)
                    if not args.json:
                        print(message.chunk.text, end="", flush=True)
                elif kind == "error":
                    print(f"\ngenerate: {message.error.message}", file=sys.stderr)
                else:
                    complete = message.complete
    except grpc.RpcError as e:
        print(f"\ngenerate: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    if args.json:
        print(json.dumps(_record("".join(text), token_ids, complete)))
    else:
        print()
    return 0 if complete is not None and complete.finish_reason != cpb.FINISH_REASON_ERROR else 1


def _record(text: str, token_ids: list[int], complete: cpb.Complete | None) -> dict:
    reason = (
        cpb.FinishReason.Name(complete.finish_reason).removeprefix("FINISH_REASON_").lower()
        if complete
        else None
    )
    usage = MessageToDict(complete.usage, preserving_proto_field_name=True) if complete else {}
    return {"text": text, "token_ids": token_ids, "finish_reason": reason, "usage": usage}
