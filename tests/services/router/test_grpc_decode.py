"""Client requests that do not decode, over a real gRPC socket: INVALID_ARGUMENT naming
the request, never UNKNOWN; decodable ones still reach the router."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto.tandem.v1 import client_pb2 as cpb
from services.common.metrics import Metrics
from services.router.api import ModelLimits, RouterAPI
from services.router.server import add_router_servicers
from tests.services.router.scripted_router import TOKENIZER


async def _call(method: str, raw: bytes) -> tuple[grpc.StatusCode, str]:
    api = RouterAPI(ModelLimits(model_id="m", max_model_len=32), Metrics("router"), tokenizer=TOKENIZER)
    server = grpc.aio.server()
    add_router_servicers(server, api)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            kind = channel.unary_stream if method == "Generate" else channel.unary_unary
            call = kind(f"/tandem.v1.Tandem/{method}")  # raw bytes in and out
            try:
                result = call(raw, timeout=5)
                _ = [m async for m in result] if method == "Generate" else await result
            except grpc.RpcError as e:
                return e.code(), e.details()
            return grpc.StatusCode.OK, ""
    finally:
        await server.stop(0)


@pytest.mark.parametrize(
    "method, raw, reason",
    [
        ("Generate", b"\x12\x02\xff\xfe", "String field had bad UTF-8"),  # text: not UTF-8
        ("Generate", b"\x12\x03\xed\xa0\x80", "String field had bad UTF-8"),  # a lone surrogate
        ("Generate", b"\xff\xff", "Wire format was corrupt"),
        ("Abort", b"\x0a\x01\xff", "String field had bad UTF-8"),
    ],
)
def test_an_undecodable_request_is_invalid_argument(method, raw, reason):
    code, details = asyncio.run(_call(method, raw))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request: undecodable (")
    assert reason in details


def test_a_decodable_request_still_reaches_the_router():
    request = cpb.GenerateRequest(token_ids=cpb.TokenIds(ids=[1] * 40)).SerializeToString()
    code, details = asyncio.run(_call("Generate", request))
    assert (code, details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt: 40 tokens leave no room in the model's 32-token context",
    )
    assert asyncio.run(_call("Health", b""))[0] == grpc.StatusCode.OK
