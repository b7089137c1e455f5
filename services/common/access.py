"""Who may call what: every gRPC method needs a caller class, CLIENT or SERVICE.

- The router's ``tandem.v1.Tandem`` methods are CLIENT calls; everything else (the router's
  ``Registration``, every worker method, an aggregated worker's ``Tandem``, which only the
  router calls) is a SERVICE call. The health checks (``OPEN_METHODS``) need nothing.
- A class with a token check needs ``authorization: Bearer <token>`` that the check maps to
  an identity: a missing or unknown token is UNAUTHENTICATED; the other class's token is
  PERMISSION_DENIED (a client token never calls a worker or registers one).
- Under mutual TLS the certificate's organizational unit is its role (``OU=client`` or
  ``OU=service``): a call of the other class is PERMISSION_DENIED.
- The caller's identity, for the handler, is ``caller_identity()``: the token check's answer
  (``worker:<instance id>`` for a worker token), else ``cert:<common name>`` under mutual
  TLS, else "" (no credential configured for the class).
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

import grpc

from services.common.security import bearer_token, same_token, token_worker

OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/tandem.v1.Tandem/Health")
"""Methods callable without credentials: probes, the schema (server reflection) and the
cluster's health summary."""

ROUTER_CLIENT_METHODS = ("/tandem.v1.Tandem/",)
"""The router's client API; all its other methods are service calls."""

_IDENTITY: ContextVar[str] = ContextVar("caller_identity", default="")

TokenCheck = Callable[[str], "str | None"]
"""A bearer token to the identity it proves, or None when it proves none."""


class Caller(enum.Enum):
    CLIENT = "client"
    SERVICE = "service"


CREDENTIAL = {Caller.CLIENT: "the client token", Caller.SERVICE: "a worker token"}
"""How refusals name each class's token."""


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    """One server's rules. ``tokens``: the token check of each class that has one (a class
    without one needs no token); ``certificates``: roles come from client certificates."""

    client_methods: tuple[str, ...] = ()
    tokens: dict[Caller, TokenCheck] = field(default_factory=dict)
    certificates: bool = False

    def caller_of(self, method: str) -> Caller | None:
        """The class ``method`` needs; None: open to anyone."""
        if method.startswith(OPEN_METHODS):
            return None
        return Caller.CLIENT if method.startswith(self.client_methods) else Caller.SERVICE

    def checks(self, caller: Caller) -> bool:
        return self.certificates or caller in self.tokens

    def identify(self, caller: Caller, method: str, context: grpc.aio.ServicerContext) -> tuple[str, str]:
        """(identity, "") for an allowed call; ("", "CODE: details") for a refused one."""
        cert_role, common_name = certificate_role(context) if self.certificates else ("", "")
        if self.certificates and cert_role != caller.value:
            shown = f"OU={cert_role}" if cert_role else "no OU"
            needs = f"needs OU={caller.value}"
            return "", f"PERMISSION_DENIED: certificate: {shown} cannot call {method} ({needs})"
        check = self.tokens.get(caller)
        if check is None:
            return f"cert:{common_name}" if self.certificates else "", ""
        token = bearer_token(context.invocation_metadata())
        identity = check(token) if token else None
        if identity is not None:
            return identity, ""
        other = Caller.SERVICE if caller == Caller.CLIENT else Caller.CLIENT
        if token and other in self.tokens and self.tokens[other](token) is not None:
            return "", (
                f"PERMISSION_DENIED: authorization: {CREDENTIAL[other]} cannot call {method} "
                f"({caller.value} calls need {CREDENTIAL[caller]})"
            )
        return "", "UNAUTHENTICATED: authorization: missing or wrong bearer token"


def router_policy(client_token: str, service_secret: str, certificates: bool) -> AccessPolicy:
    """The router's: clients with the client token, workers with their worker tokens."""
    tokens: dict[Caller, TokenCheck] = {}
    if client_token:
        tokens[Caller.CLIENT] = lambda t: "client" if same_token(t, client_token) else None
    if service_secret:
        tokens[Caller.SERVICE] = lambda t: f"worker:{w}" if (w := token_worker(service_secret, t)) else None
    return AccessPolicy(ROUTER_CLIENT_METHODS, tokens, certificates)


def worker_policy(own_token: str, certificates: bool) -> AccessPolicy:
    """A worker's: every method a service call, carrying this worker's own token."""
    tokens: dict[Caller, TokenCheck] = {}
    if own_token:
        tokens[Caller.SERVICE] = lambda t: "router" if same_token(t, own_token) else None
    return AccessPolicy((), tokens, certificates)


def caller_identity() -> str:
    """The identity of the call being handled (see the module docstring)."""
    return _IDENTITY.get()


def client_owner(context: grpc.aio.ServicerContext) -> str:
    """Whose a client's request is: its certificate's subject under mutual TLS, else its
    connection (clients holding one shared token are told apart by their channels)."""
    _, common_name = certificate_role(context)
    return f"cert:{common_name}" if common_name else f"peer:{context.peer()}"


def certificate_role(context: grpc.aio.ServicerContext) -> tuple[str, str]:
    """(OU, CN) of the peer's certificate; ("", "") without one."""
    auth = context.auth_context() or {}
    subject = b"".join(auth.get("x509_subject", [])).decode(errors="replace")
    parts = dict(p.split("=", 1) for p in subject.split(",") if "=" in p)
    common_name = b"".join(auth.get("x509_common_name", [])).decode(errors="replace")
    return parts.get("OU", ""), common_name


class AccessCheck(grpc.aio.ServerInterceptor):
    """Enforces an AccessPolicy on every method of a server."""

    def __init__(self, policy: AccessPolicy) -> None:
        self.policy = policy

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        caller = self.policy.caller_of(details.method)
        if handler is None or caller is None or not self.policy.checks(caller):
            return handler
        return _guarded(handler, self.policy, caller, details.method)


def _guarded(handler: grpc.RpcMethodHandler, policy: AccessPolicy, caller: Caller, method: str):
    """``handler`` with the policy checked first (the identity set for its behaviour)."""

    async def admit(context) -> None:
        identity, refusal = policy.identify(caller, method, context)
        if refusal:
            code, details = refusal.split(": ", 1)
            await context.abort(grpc.StatusCode[code], details)
        _IDENTITY.set(identity)

    kind = _kind(handler)
    behaviour = getattr(handler, kind)
    if inspect.isasyncgenfunction(behaviour):

        async def guarded_stream(request, context):
            await admit(context)
            async for item in behaviour(request, context):
                yield item

        return handler._replace(**{kind: guarded_stream})

    async def guarded(request, context):
        await admit(context)
        return await behaviour(request, context)

    return handler._replace(**{kind: guarded})


def _kind(handler: grpc.RpcMethodHandler) -> str:
    return {
        (False, False): "unary_unary",
        (False, True): "unary_stream",
        (True, False): "stream_unary",
        (True, True): "stream_stream",
    }[(handler.request_streaming, handler.response_streaming)]
