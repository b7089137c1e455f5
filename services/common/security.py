"""Security of every gRPC hop: optional mutual TLS, and an optional bearer token.

With ``TlsConfig`` set, servers require client certificates signed by the CA and channels
present theirs; without it everything is plaintext on the bound address (127.0.0.1 locally).
With a token set, every RPC but the health checks must carry ``authorization: Bearer
<token>`` (UNAUTHENTICATED otherwise), and services send it on their own calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert: str  # PEM certificate of this process
    key: str  # PEM private key
    ca: str  # PEM CA that signs every peer

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            if not Path(getattr(self, name)).is_file():
                raise ValueError(f"tls_{name}: no such file {getattr(self, name)!r}")

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return (Path(self.key).read_bytes(), Path(self.cert).read_bytes(), Path(self.ca).read_bytes())

    def server_credentials(self) -> grpc.ServerCredentials:
        key, cert, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        key, cert, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def tls_from(cert: str = "", key: str = "", ca: str = "") -> TlsConfig | None:
    """None when no file is given; all three or a ValueError naming the missing one."""
    if not (cert or key or ca):
        return None
    for name, value in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)):
        if not value:
            raise ValueError(f"{name}: mutual TLS needs --tls-cert, --tls-key and --tls-ca")
    return TlsConfig(cert, key, ca)


OPEN_METHODS = ("/grpc.health.v1.Health/", "/tandem.v1.Tandem/Health")
"""Methods callable without the token: probes and the cluster's health summary."""


def aio_channel(address: str, tls: TlsConfig | None = None, token: str = "") -> grpc.aio.Channel:
    """A channel to a Tandem service, with TLS and the token when configured."""
    interceptors = [_TokenUnary(token), _TokenStream(token)] if token else None
    if tls is None:
        return grpc.aio.insecure_channel(address, interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), interceptors=interceptors)


def bearer_token(metadata) -> str:
    """The token of an ``authorization: Bearer <token>`` metadata entry, or ""."""
    for key, value in metadata or ():
        if key == "authorization" and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return ""


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every RPC outside OPEN_METHODS that lacks the bearer token."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_METHODS) or bearer_token(details.invocation_metadata) == self.token:
            return await continuation(details)
        handler = await continuation(details)
        return _refusal(handler)


def _refusal(handler):
    """A handler of the same kind that ends the RPC with UNAUTHENTICATED."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong bearer token")

    async def refuse_stream(request, context):
        await refuse(request, context)
        yield  # pragma: no cover - abort raises first

    if handler is None:
        return None
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            refuse_stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return grpc.unary_unary_rpc_method_handler(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _with_token(details, token: str):
    metadata = list(details.metadata or []) + [("authorization", f"Bearer {token}")]
    return details._replace(metadata=metadata)


class _TokenUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)


class _TokenStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)
