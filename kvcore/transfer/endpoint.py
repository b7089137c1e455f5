"""How peers reach one rank's transport: the :class:`EndpointInfo` a rank publishes.

An endpoint names its backend; what its address fields mean is that backend's (UCX: the
worker address, and a listener's host and port). Two ranks whose endpoints name different
backends cannot move pages between them: pairing refuses them, and a transport refuses to
connect to a foreign endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    """One rank's endpoint; mirrors the ``TransferEndpoint`` proto message."""

    backend: str  # the transport that publishes it, e.g. "ucx"
    address: bytes = b""  # the backend's address of this rank (UCX: its worker address)
    host: str = ""  # a listener's host; "" = none
    port: int = 0  # a listener's port; 0 = none
