"""Client requests that do not decode answer INVALID_ARGUMENT, not UNKNOWN.

grpc decodes a request before the servicer runs and answers a ``DecodeError`` (bad UTF-8
in a string field, a corrupt wire format) with UNKNOWN. ``add_checked`` registers a
servicer through its generated ``add_..._to_server`` function with every unary request
decoded leniently: an undecodable one reaches a guard that ends the call with
INVALID_ARGUMENT, ``request: undecodable (...)``, before the servicer sees it.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError


class Undecodable:
    """What a lenient decoder returns for bytes that are not the request type."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Capture:
    """Stands in for a server to catch the handlers a generated add function registers."""

    def __init__(self) -> None:
        self.service, self.handlers = "", {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, handlers


def add_checked(add: Callable, servicer, server: grpc.aio.Server) -> None:
    """``add(servicer, server)`` (a generated function), undecodable requests refused."""
    capture = _Capture()
    add(servicer, capture)
    handlers = {name: _checked(handler) for name, handler in capture.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, handlers),))
    server.add_registered_method_handlers(capture.service, handlers)


def _checked(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_streaming:
        return handler  # a stream's messages decode one by one; none is served here
    kind = "unary_stream" if handler.response_streaming else "unary_unary"
    return handler._replace(
        request_deserializer=_lenient(handler.request_deserializer), **{kind: _guard(getattr(handler, kind))}
    )


def _lenient(decode: Callable) -> Callable:
    def lenient(raw: bytes):
        try:
            return decode(raw)
        except DecodeError as e:
            return Undecodable(str(e))

    return lenient


def _guard(behaviour: Callable) -> Callable:
    async def guarded(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: undecodable ({request.reason})")
        return await behaviour(request, context)

    return guarded
