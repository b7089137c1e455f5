"""A local cluster on 127.0.0.1: one router process and worker processes registering with it.

Each process prints one line naming its gRPC address and metrics URL; the cluster is
ready when the router reports SERVING (every pair registered and test-transferred).

``stop`` stops the routers first, then the workers: each router stops admitting and
finishes (or, past its --shutdown-timeout-s, cuts) the requests in flight while every
worker still serves them; once the routers have exited nothing is in flight, and the
workers deregister, free their pages and exit. A process still running ``stop_wait_s``
after its SIGTERM is killed. ``tandem up`` (``from_args``) starts its children in their
own process group, so a terminal's Ctrl-C reaches ``tandem up`` alone, which stops them in
that order.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc

from deploy.options import (
    ROUTER_ENGINE_OPTIONS,
    ROUTER_ONLY_SERVING,
    EngineOptions,
    ProcessOptions,
    RouterOptions,
    ServingOptions,
    from_args,
    to_argv,
)
from deploy.placement import place_workers
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc

LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
_ENDPOINT = re.compile(r"grpc=(\S+) metrics=(\S+)")
_HTTP = re.compile(r"http=(\S+)")
# services/common/log_setup.py's formats: text, then json
_WARNING = re.compile(r'^\S+ \S+ (WARNING|ERROR) |^\{.*"level": "(WARNING|ERROR)"')
DEFAULT_HTTP_PORT = 8000  # the router's OpenAI-compatible HTTP port, as vLLM's
STOP_WAIT_S = 10.0  # after its SIGTERM, how long a process may take to exit before it is killed
STOP_MARGIN_S = 10.0  # tandem up: the processes' --shutdown-timeout-s plus this


@dataclass(slots=True)
class Process:
    name: str
    popen: subprocess.Popen
    grpc: str = ""
    metrics: str = ""
    http: str = ""  # the router's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000
    log: list[str] = field(default_factory=list)
    argv: list[str] = field(default_factory=list)
    pump: threading.Thread | None = None  # reads ``log``; done once the process's output ends

    def exit_error(self) -> RuntimeError:
        """The error of this process having exited: its status and last line (its refusal,
        e.g. a busy port), once its output is read to the end."""
        if self.pump is not None:
            self.pump.join(timeout=5)
        last = self.log[-1].strip() if self.log else "(no output)"
        return RuntimeError(f"{self.name} exited with {self.popen.returncode}: {last}")


class LocalCluster:
    def __init__(
        self,
        worker_args: list[str],
        router_args: list[str],
        roles: list[str | tuple[str, list[str]]],
        port: int = 0,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 120.0,
        expected_pairs: int | None = None,
        http_port: int = 0,
        credentials: grpc.ChannelCredentials | None = None,
        routers: int = 1,
    ) -> None:
        """``roles``: one entry per worker, a role or (role, extra worker arguments).
        ``http_port``: the router's OpenAI-compatible HTTP port (0 = any free, -1 = off).
        ``credentials``: how this process reaches the router when it runs mutual TLS.
        ``routers``: router replicas; every worker registers with each (the first one takes
        ``port`` and ``http_port``, the others any free gRPC port and no HTTP)."""
        self.credentials = credentials
        self.num_routers = routers
        self.worker_args, self.router_args = worker_args, router_args
        self.extra = [r[1] if isinstance(r, tuple) else [] for r in roles]
        self.roles = [r[0] if isinstance(r, tuple) else r for r in roles]
        self.port = port
        self.http_port = http_port
        self.env = {**os.environ, **LOOPBACK_ENV, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.expected_pairs = expected_pairs
        self.processes: list[Process] = []
        self.echo_warnings = False  # `tandem up`: every process's WARNING and ERROR lines to stderr
        self.stop_wait_s = STOP_WAIT_S
        self.own_group = False  # `tandem up`: children in their own process group (no terminal SIGINT)

    @classmethod
    def from_args(cls, args) -> LocalCluster:
        """The cluster ``tandem up`` parsed into ``args``. Workers get every engine flag but
        the TP size (given per role), and the served name; the router gets the engine flags
        it reads, every serving flag and its own (RouterOptions); both get the process flags
        (the log level). Flags at their defaults are left out."""
        engine = from_args(EngineOptions, args)
        serving = from_args(ServingOptions, args)
        process = to_argv(from_args(ProcessOptions, args))
        worker = to_argv(engine, exclude=("tp",)) + to_argv(serving, exclude=ROUTER_ONLY_SERVING) + process
        router = to_argv(engine, names=ROUTER_ENGINE_OPTIONS) + to_argv(serving) + process
        router += to_argv(from_args(RouterOptions, args))
        tp = {"both": args.tp, "prefill": args.prefill_tp or args.tp, "decode": args.decode_tp or args.tp}
        names = (
            ["both"] * args.aggregated
            if args.aggregated
            else ["prefill"] * args.prefill + ["decode"] * args.decode
        )
        roles = place_workers(engine, [(role, ["--tp", str(tp[role])]) for role in names], args.gpus)
        http_port = args.http_port
        if http_port is None:  # with --port 0 every port is a free one, HTTP's too
            http_port = 0 if args.port == 0 else DEFAULT_HTTP_PORT
        cluster = cls(
            worker,
            router,
            roles,
            port=args.port,
            http_port=http_port,
            env=credentials_env(args.token),
            routers=args.routers,
        )
        cluster.echo_warnings = True
        cluster.own_group = True
        cluster.stop_wait_s = args.shutdown_timeout_s + STOP_MARGIN_S
        return cluster

    @property
    def router_address(self) -> str:
        return self.processes[0].grpc

    @property
    def http_address(self) -> str:
        """The router's OpenAI-compatible base URL (``http://host:port``); "" when off."""
        return self.processes[0].http

    def start(self) -> None:
        """Start every process and wait until serving; on failure print the processes'
        logs, stop them all and raise (a process that exited: its status and last line)."""
        try:
            self._start()
        except Exception:
            print(self.logs(), file=sys.stderr)
            self.stop()
            raise

    def _start(self) -> None:
        routers = []
        for r in range(self.num_routers):
            ports = (
                ["--port", str(self.port), "--http-port", str(self.http_port)]
                if r == 0
                else ["--port", "0", "--http-port", "-1"]
            )
            routers.append(
                self._spawn("router" if r == 0 else f"router-{r}", ["router", *ports, *self.router_args])
            )
        for router in routers:
            self._wait_endpoint(router)
        for i, role in enumerate(self.roles):
            self._spawn(
                f"{role}-{i}",
                [
                    "worker",
                    "--role",
                    role,
                    "--router",
                    ",".join(r.grpc for r in routers),
                    "--instance-id",
                    f"{role}-{i}",
                    *self.worker_args,
                    *self.extra[i],
                ],
            )
        for p in self.processes[self.num_routers :]:
            self._wait_endpoint(p)
        for router in routers:
            self.wait_serving(router.grpc)

    def wait_serving(self, address: str = "") -> None:
        """Wait until every prefill/decode pair is READY (or every aggregated worker joined)
        at the router (or the one at ``address``)."""
        pairs = self.expected_pairs
        if pairs is None:
            pairs = self.roles.count("prefill") * self.roles.count("decode")
        aggregated = self.roles.count("both")
        deadline = time.monotonic() + self.start_timeout_s
        health = cpb.HealthResponse()
        with self.channel(address) as channel:
            stub = cpb_grpc.TandemStub(channel)
            while time.monotonic() < deadline:
                health = stub.Health(cpb.HealthRequest(), timeout=5)
                if (
                    health.num_ready_pairs >= pairs
                    and health.num_aggregated_workers >= aggregated
                    and health.status == cpb.SERVING_STATUS_SERVING
                ):
                    return
                self._check_alive()
                time.sleep(0.2)
        raise RuntimeError(
            f"cluster not serving after {self.start_timeout_s} s: "
            f"{health.num_ready_pairs}/{pairs} pairs ready; {health.message}"
        )

    def channel(self, address: str = "") -> grpc.Channel:
        """A blocking channel to the router (or ``address``), with TLS when configured."""
        address = address or self.router_address
        if self.credentials is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(address, self.credentials)

    def describe(self) -> str:
        lines = [f"{p.name:<12} grpc={p.grpc}  metrics={p.metrics}" for p in self.processes]
        clients = [f"clients: gRPC tandem.v1.Tandem at {self.router_address}"]
        if self.http_address:
            clients.append(f"         OpenAI-compatible HTTP at {self.http_address}/v1")
        return "\n".join(["tandem local cluster (Ctrl-C stops it):", *lines, *clients])

    def alive(self) -> bool:
        return all(p.popen.poll() is None for p in self.processes)

    def stop(self) -> None:
        """SIGTERM the routers, wait for them to exit, then the same for the workers (the
        module docstring says why); kill what is still running after ``stop_wait_s``, and
        everything at once on a KeyboardInterrupt (a second Ctrl-C)."""
        routers = [p for p in self.processes if p.name.startswith("router")]
        workers = [p for p in self.processes if p not in routers]
        try:
            for group in (routers, workers):
                for p in group:
                    if p.popen.poll() is None:
                        p.popen.terminate()
                deadline = time.monotonic() + self.stop_wait_s
                for p in group:
                    try:
                        p.popen.wait(timeout=max(deadline - time.monotonic(), 0.01))
                    except subprocess.TimeoutExpired:
                        p.popen.kill()
                        p.popen.wait()
        finally:
            for p in self.processes:
                if p.popen.poll() is None:
                    p.popen.kill()
                    p.popen.wait()

    def kill(self, name: str) -> None:
        """SIGKILL a process; it stays listed (dead) until ``restart``."""
        for p in self.processes:
            if p.name == name:
                p.popen.kill()
                p.popen.wait()

    def restart(self, name: str) -> None:
        """Start a killed process again, with the same arguments (new ports)."""
        i = next(i for i, p in enumerate(self.processes) if p.name == name)
        old = self.processes.pop(i)
        if old.popen.poll() is None:
            raise RuntimeError(f"{name} is still running")
        new = self._spawn(name, old.argv)
        self.processes.remove(new)
        self.processes.insert(i, new)
        self._wait_endpoint(new)

    def living(self) -> list[Process]:
        return [p for p in self.processes if p.popen.poll() is None]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "".join(p.log[-40:]) for p in self.processes)

    # ------------------------------------------------------------------ internals

    def _spawn(self, name: str, argv: list[str]) -> Process:
        popen = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", *argv],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0 if self.own_group else None,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        process = Process(name, popen, argv=argv)
        process.pump = threading.Thread(target=_pump, args=(process, self.echo_warnings), daemon=True)
        process.pump.start()
        self.processes.append(process)
        return process

    def _wait_endpoint(self, process: Process) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and not process.grpc:
            if process.popen.poll() is not None:
                raise process.exit_error()
            time.sleep(0.05)
        if not process.grpc:
            raise RuntimeError(f"{process.name} printed no endpoint in {self.start_timeout_s} s")

    def _check_alive(self) -> None:
        for p in self.processes:
            if p.popen.poll() is not None:
                raise p.exit_error()


def _pump(process: Process, echo_warnings: bool = False) -> None:
    """Keep a process's output (its endpoints line, its log); echo it all with
    TANDEM_ECHO_LOGS, or only its WARNING and ERROR lines with ``echo_warnings``."""
    for line in process.popen.stdout:
        process.log.append(line)
        match = _ENDPOINT.search(line)
        if match and not process.grpc:
            http = _HTTP.search(line)
            process.http = http.group(1) if http else ""  # before grpc, which readers wait on
            process.grpc, process.metrics = match.group(1), match.group(2)
        if os.environ.get("TANDEM_ECHO_LOGS") or (echo_warnings and _WARNING.search(line)):
            sys.stderr.write(f"[{process.name}] {line}")


def credentials_env(client_token: str) -> dict[str, str]:
    """The processes' environment for a client token: the router reads it, and every process a
    fresh service secret (in the environment, not the command line)."""
    if not client_token:
        return {}
    return {"TANDEM_TOKEN": client_token, "TANDEM_SERVICE_TOKEN": secrets.token_hex(16)}
