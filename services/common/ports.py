"""Listening ports are a process's own: no server shares one (no ``SO_REUSEPORT``), and a
port another socket holds fails the start, named.

- ``PortInUse`` says which server (gRPC, HTTP, metrics) could not have which address;
- ``claimed`` turns a bind's EADDRINUSE into ``PortInUse``;
- ``exit_on_busy_port`` turns ``PortInUse`` into the process's one-line exit naming its role.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from contextlib import contextmanager


class PortInUse(OSError):
    """``server`` (gRPC, HTTP, metrics) could not listen on ``address`` (host:port): another
    socket holds it."""

    def __init__(self, server: str, address: str) -> None:
        super().__init__(errno.EADDRINUSE, f"{server} port {address} is in use")
        self.server, self.address = server, address

    def __str__(self) -> str:
        return self.strerror


@contextmanager
def claimed(server: str, host: str, port: int) -> Iterator[None]:
    """Around a bind of ``host:port`` by ``server``: EADDRINUSE becomes ``PortInUse``."""
    try:
        yield
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(server, f"{host}:{port}") from None
        raise


def is_busy(host: str, port: int) -> bool:
    """Whether a plain bind of ``host:port`` (no ``SO_REUSEPORT``) fails with EADDRINUSE:
    tells a busy port from other causes where the bind (gRPC's) names none."""
    try:
        found = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = found[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as every server here
            probe.bind(address)
    except OSError as e:
        return e.errno == errno.EADDRINUSE
    return False


@contextmanager
def exit_on_busy_port(role: str) -> Iterator[None]:
    """Around a process's serving: a busy port ends it with ``tandem: <role>: <port> is in
    use`` on stderr and exit status 1."""
    try:
        yield
    except PortInUse as e:
        raise SystemExit(f"tandem: {role}: {e}") from None
