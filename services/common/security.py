"""Credentials of every gRPC hop: optional mutual TLS, and bearer tokens.

With ``TlsConfig`` set, servers require client certificates signed by the CA and channels
present theirs; without it everything is plaintext on the bound address (127.0.0.1 locally).
Tokens ride as ``authorization: Bearer <token>`` (what each server accepts: access.py):
- the client token, which clients send to the router;
- worker tokens, one per worker instance id, derived from the cluster's service secret
  (``worker_token``): a worker sends its own to the router, and the router sends worker X's
  token on its calls to X. Holding one worker's token proves that identity and no other.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert: str  # PEM certificate of this process
    key: str  # PEM private key
    ca: str  # PEM CA that signs every peer
    server_name: str = ""  # the name servers' certificates are checked against; "" = the address's host

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            if not Path(getattr(self, name)).is_file():
                raise ValueError(f"tls_{name}: no such file {getattr(self, name)!r}")

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return (Path(self.key).read_bytes(), Path(self.cert).read_bytes(), Path(self.ca).read_bytes())

    def server_credentials(self) -> grpc.ServerCredentials:
        key, cert, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_options(self) -> list[tuple[str, str]]:
        """Channel options: with ``server_name``, every server's certificate must name it
        (one certificate for pods whose addresses no certificate can list)."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def channel_credentials(self) -> grpc.ChannelCredentials:
        key, cert, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def tls_from(cert: str = "", key: str = "", ca: str = "", server_name: str = "") -> TlsConfig | None:
    """None when no file is given; all three or a ValueError naming the missing one."""
    if not (cert or key or ca):
        if server_name:
            raise ValueError("tls_server_name: needs mutual TLS (--tls-cert, --tls-key and --tls-ca)")
        return None
    for name, value in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)):
        if not value:
            raise ValueError(f"{name}: mutual TLS needs --tls-cert, --tls-key and --tls-ca")
    return TlsConfig(cert, key, ca, server_name)


def worker_token(service_secret: str, instance_id: str) -> str:
    """The token of worker ``instance_id`` under ``service_secret``: ``<id>.<40 hex digits>``."""
    mac = hmac.new(service_secret.encode(), f"tandem-worker:{instance_id}".encode(), hashlib.sha256)
    return f"{instance_id}.{mac.hexdigest()[:40]}"


def token_worker(service_secret: str, token: str) -> str | None:
    """The instance id whose worker token ``token`` is under ``service_secret``, or None."""
    instance_id, _, _ = token.rpartition(".")
    if not instance_id or not service_secret:
        return None
    return instance_id if same_token(token, worker_token(service_secret, instance_id)) else None


def same_token(a: str, b: str) -> bool:
    """Constant-time equality of two tokens."""
    return hmac.compare_digest(a.encode(), b.encode())


def aio_channel(
    address: str,
    tls: TlsConfig | None = None,
    token: str = "",
    options: list[tuple[str, object]] | None = None,
) -> grpc.aio.Channel:
    """A channel to a Tandem service, with TLS and the token when configured; ``options``:
    more grpc channel options."""
    interceptors = [_TokenUnary(token), _TokenStream(token)] if token else None
    options = list(options or [])
    if tls is None:
        return grpc.aio.insecure_channel(address, options, interceptors=interceptors)
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), tls.channel_options() + options, interceptors=interceptors
    )


def bearer_token(metadata) -> str:
    """The token of an ``authorization: Bearer <token>`` metadata entry, or ""."""
    for key, value in metadata or ():
        if key == "authorization" and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return ""


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
