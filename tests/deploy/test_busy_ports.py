"""A port another process holds fails a router's or worker's start at once, with one line
naming the port and the process's role, and a non-zero exit: never a shared port (gRPC's
default SO_REUSEPORT let a second router take a share of the clients), never a hang."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from deploy.local import LOOPBACK_ENV


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port a listening socket of this process holds."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def tandem(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **LOOPBACK_ENV}
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *argv], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.parametrize(("flag", "server"), [("--port", "gRPC"), ("--http-port", "HTTP")])
def test_a_router_on_a_busy_port_exits_naming_the_port(busy_port, flag, server):
    ports = {"--port": "0", "--http-port": "0", flag: str(busy_port)}
    done = tandem("router", *(x for kv in ports.items() for x in kv))
    assert done.returncode != 0
    assert done.stderr.splitlines()[-1] == f"tandem: router: {server} port 127.0.0.1:{busy_port} is in use"


def test_a_worker_on_a_busy_grpc_port_exits_naming_the_port(busy_port):
    done = tandem(
        "worker",
        "--role",
        "decode",
        "--instance-id",
        "d0",
        "--router",
        "127.0.0.1:1",
        "--port",
        str(busy_port),
    )
    assert done.returncode != 0
    assert (
        done.stderr.splitlines()[-1] == f"tandem: decode worker d0: gRPC port 127.0.0.1:{busy_port} is in use"
    )


def test_up_on_a_busy_port_fails_at_once_with_the_routers_line(busy_port):
    done = tandem("up", "--port", str(busy_port))
    assert done.returncode != 0
    refusal = f"tandem: router: gRPC port 127.0.0.1:{busy_port} is in use"
    assert done.stderr.splitlines()[-1] == f"tandem up: router exited with 1: {refusal}"
