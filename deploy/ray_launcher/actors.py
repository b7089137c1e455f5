"""The Ray actor that hosts one Tandem service (the router or a worker).

Inside the actor the service is exactly what the CLI runs (``run_router`` /
``run_worker``), on its own asyncio loop in a thread, so the actor stays free to answer
``health`` and ``stop``. Services bind to the node's IP address as Ray reports it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Coroutine

import ray

from deploy.options import served_model_name
from deploy.ray_launcher.config import ClusterConfig
from deploy.ray_launcher.service_configs import Listen, router_settings, worker_config
from proto.tandem.v1 import client_pb2 as cpb
from services.common.log_setup import configure_logging
from services.router.chat_template import load_chat_template
from services.router.main import RouterConfig, model_limits, openai_options, run_router
from services.tokenization.tokenizer import load_tokenizer

ServeFn = Callable[[asyncio.Event, asyncio.Event], Coroutine]


class ServiceThread:
    """Runs ``serve(ready, stop)`` on a fresh event loop in a daemon thread."""

    def __init__(self, name: str, serve: ServeFn) -> None:
        self.name = name
        self._serve = serve
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self, timeout_s: float) -> None:
        """Return once the service is ready; raise if it failed or took too long."""
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"{self.name}: not ready after {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"{self.name}: {type(self._error).__name__}: {self._error}")

    def call(self, coro: Coroutine, timeout_s: float = 10.0):
        """Run ``coro`` on the service's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop(self, timeout_s: float = 15.0) -> bool:
        """Ask the service to stop; True when its thread ended in time."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _main(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._run())
        finally:
            loop.close()

    async def _run(self) -> None:
        ready, self._stop = asyncio.Event(), asyncio.Event()
        waiter = asyncio.ensure_future(ready.wait())
        waiter.add_done_callback(lambda _: self._started.set())
        try:
            await self._serve(ready, self._stop)
        except BaseException as e:  # reported by start(); the actor itself stays up
            self._error = e
        finally:
            waiter.cancel()
            self._started.set()


class ServiceActor:
    """One service per actor; ``start_router`` or ``start_worker`` is called once."""

    def __init__(self) -> None:
        self.host = ray.util.get_node_ip_address()
        self.service: ServiceThread | None = None
        self.bound: dict = {}

    def start_router(self, cluster: ClusterConfig) -> dict:
        """Start ``cluster``'s router; returns its endpoints (grpc host:port, http and
        metrics URLs)."""
        configure_logging(cluster.log_level, "router", cluster.log_format)
        model, options = cluster.model, cluster.router
        engine = model.engine_options()
        name = served_model_name(engine.model, model.served_model_name)
        limits = model_limits(engine.model, engine.num_spec_tokens, engine.max_model_len, name)
        tokenizer = load_tokenizer(engine.model, engine.tokenizer)  # ValueError names what is wrong
        tokenizer.special_in_text = model.prompt_special_tokens == "parse"
        chat = load_chat_template(tokenizer, model.chat_template_path)
        openai = openai_options(
            engine.model, model.generation_config_path, model.reasoning_parser, model.tool_call_parser
        )
        http_port = None if options.http_port < 0 else options.http_port
        settings = router_settings(cluster)  # ValueError names a missing TLS file

        def serve(ready: asyncio.Event, stop: asyncio.Event):
            config = RouterConfig(
                limits,
                settings,
                self.host,
                options.port,
                options.metrics_port,
                http_port,
                tokenizer,
                chat,
                openai=openai,
                process=cluster.process_settings(),
            )
            return run_router(config, ready, stop, self.bound)

        self._start("router", serve, cluster.ready_timeout_s)
        b = self.bound
        return {
            "name": "router",
            "node": self.host,
            "grpc": f"{self.host}:{b['port']}",
            "metrics": f"http://{self.host}:{b['metrics_port']}/metrics",
            "http": f"http://{self.host}:{b['http_port']}" if b["http_port"] else "",
        }

    def start_worker(self, cluster: ClusterConfig, role: str, instance_id: str, router: str) -> dict:
        """Start a worker of ``cluster``'s ``role`` section (prefill, decode or aggregated)
        that registers with ``router`` (host:port); returns its endpoints. A refused engine
        option raises ValueError naming it."""
        # the worker runs an engine: torch and its models load in its actor, never in the launcher
        from services.worker.serve import run_worker  # noqa: PLC0415 (torch: the router actor stays light)
        from services.worker_roles import WORKER_ROLES  # noqa: PLC0415

        configure_logging(cluster.log_level, instance_id, cluster.log_format)
        options = getattr(cluster, role)
        port = options.port or _free_port(self.host)
        metrics_port = options.metrics_port or _free_port(self.host)
        config = worker_config(cluster, role, instance_id, router, Listen(self.host, port, metrics_port))
        name = served_model_name(config.engine.model, cluster.model.served_model_name)
        self._start(
            instance_id,
            lambda ready, stop: run_worker(config, WORKER_ROLES[config.role], ready, stop, name),
            cluster.ready_timeout_s,
        )
        return {
            "name": instance_id,
            "node": self.host,
            "grpc": f"{self.host}:{port}",
            "metrics": f"http://{self.host}:{metrics_port}/metrics",
            "http": "",
        }

    def health(self) -> dict:
        """The router's Health, as a dict (router actors only)."""
        h = self.service.call(self.bound["router"].health())
        return {
            "serving": h.status == cpb.SERVING_STATUS_SERVING,
            "num_ready_pairs": h.num_ready_pairs,
            "num_prefill_workers": h.num_prefill_workers,
            "num_decode_workers": h.num_decode_workers,
            "num_aggregated_workers": h.num_aggregated_workers,
            "message": h.message,
        }

    def stop(self) -> bool:
        return self.service.stop() if self.service is not None else True

    def _start(self, name: str, serve: ServeFn, timeout_s: float) -> None:
        if self.service is not None:
            raise RuntimeError(f"{name}: this actor already runs {self.service.name}")
        self.service = ServiceThread(name, serve)
        self.service.start(timeout_s)


def _free_port(host: str) -> int:
    """A port free on ``host`` right now (for a service that must report its port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
