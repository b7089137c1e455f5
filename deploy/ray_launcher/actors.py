"""The Ray actor that hosts one Tandem service (the router or a worker).

Inside the actor the service is exactly what the CLI runs (``run_router`` /
``run_worker``), on its own asyncio loop in a thread, so the actor stays free to answer
``health`` and ``stop``. Services bind to the node's IP address as Ray reports it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import threading
from collections.abc import Callable, Coroutine

from deploy.ray_launcher.config import ModelOptions, RouterOptions, WorkerOptions

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
        import ray

        self.host = ray.util.get_node_ip_address()
        self.service: ServiceThread | None = None
        self.bound: dict = {}

    def start_router(self, model: ModelOptions, options: RouterOptions, timeout_s: float) -> dict:
        """Start the router; returns its endpoints (grpc host:port, http and metrics URLs)."""
        from deploy.cli import served_model_name
        from services.router.main import model_limits, router_text, run_router

        args = engine_args(model)
        limits = model_limits(args.model, args.num_spec_tokens, served_model_name=served_model_name(args))
        try:
            tokenizer, chat = router_text(args.model, args.tokenizer, args.chat_template)
        except SystemExit as e:  # a missing or malformed tokenizer or chat template
            raise ValueError(str(e)) from None
        http_port = None if options.http_port < 0 else options.http_port

        def serve(ready: asyncio.Event, stop: asyncio.Event):
            return run_router(
                limits,
                self.host,
                options.port,
                options.metrics_port,
                args.tokens_per_page,
                ready=ready,
                stop=stop,
                bound=self.bound,
                http_port=http_port,
                tokenizer=tokenizer,
                chat=chat,
            )

        self._start("router", serve, timeout_s)
        b = self.bound
        return {
            "name": "router",
            "node": self.host,
            "grpc": f"{self.host}:{b['port']}",
            "metrics": f"http://{self.host}:{b['metrics_port']}/metrics",
            "http": f"http://{self.host}:{b['http_port']}" if b["http_port"] else "",
        }

    def start_worker(
        self,
        role: str,
        instance_id: str,
        model: ModelOptions,
        options: WorkerOptions,
        router: str,
        timeout_s: float,
    ) -> dict:
        """Start a worker that registers with ``router`` (host:port); returns its endpoints."""
        from deploy.cli import engine_config, served_model_name
        from services.common.serve import run_worker
        from services.common.worker import WorkerConfig
        from services.worker_roles import WORKER_ROLES

        args = engine_args(model)
        try:
            engine = engine_config(args)
        except SystemExit as e:  # the CLI's refusal of an impossible layout
            raise ValueError(str(e)) from None
        port = options.port or _free_port(self.host)
        metrics_port = options.metrics_port or _free_port(self.host)
        config = WorkerConfig(
            role=role,
            engine=engine,
            host=self.host,
            port=port,
            metrics_port=metrics_port,
            router=router,
            instance_id=instance_id,
        )
        name = served_model_name(args)
        self._start(
            instance_id,
            lambda ready, stop: run_worker(config, WORKER_ROLES[role], ready, stop, name),
            timeout_s,
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
        from proto.tandem.v1 import client_pb2 as cpb

        h = self.service.call(self.bound["router"].health())
        return {
            "serving": h.status == cpb.SERVING_STATUS_SERVING,
            "num_ready_pairs": h.num_ready_pairs,
            "num_prefill_workers": h.num_prefill_workers,
            "num_decode_workers": h.num_decode_workers,
            "message": h.message,
        }

    def stop(self) -> bool:
        return self.service.stop() if self.service is not None else True

    def _start(self, name: str, serve: ServeFn, timeout_s: float) -> None:
        if self.service is not None:
            raise RuntimeError(f"{name}: this actor already runs {self.service.name}")
        self.service = ServiceThread(name, serve)
        self.service.start(timeout_s)


def engine_args(model: ModelOptions) -> argparse.Namespace:
    """The engine flags of ``tandem worker`` from cluster.yaml's ``model`` section.
    Relative paths are taken from the Tandem source tree (where ``models/`` lives)."""
    from deploy.cli import DEFAULT_DRAFTER, DEFAULT_MODEL, HERE

    drafter = model.drafter or DEFAULT_DRAFTER
    if drafter != "none":
        drafter = os.path.join(HERE, drafter)
    here = lambda path: os.path.join(HERE, path) if path else ""
    return argparse.Namespace(
        model=os.path.join(HERE, model.model or DEFAULT_MODEL),
        drafter=drafter,
        tokenizer=here(model.tokenizer),
        chat_template=here(model.chat_template),
        served_model_name=model.served_model_name,
        num_spec_tokens=model.num_spec_tokens,
        layout=model.layout,
        device=model.device,
        dtype=model.dtype,
        tokens_per_page=model.tokens_per_page,
        kv_cache_mb=model.kv_cache_mb,
        host_kv_cache_mb=0,
        host_kv_write_policy="evict",
        host_kv_recall_min_pages=1,
        max_num_seqs=model.max_num_seqs,
        no_prefix_cache=not model.prefix_cache,
    )


def _free_port(host: str) -> int:
    """A port free on ``host`` right now (for a service that must report its port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
