"""Running the router process."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass, field

from services.common.access import router_policy
from services.common.grpc_server import SERVING, start_server, wait_for_stop
from services.common.loop_watch import watch_loop
from services.common.metrics import Metrics, serve_metrics
from services.common.periodic import every
from services.common.ports import PortInUse
from services.common.process_settings import ProcessSettings
from services.router.api import ModelLimits, RouterAPI, RouterSettings
from services.router.chat_template import ChatTemplate, load_chat_template
from services.router.cluster import Deadlines
from services.router.generation_defaults import load_sampling_defaults
from services.router.http import HttpLimits, HttpServer
from services.router.openai_api import OpenAIOptions, OpenAIServer
from services.router.server import add_router_servicers
from services.router.shutdown import shut_down
from services.router.stats_log import RouterStatsLine
from services.tokenization.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


def model_limits(
    model_dir: str,
    num_spec_tokens: int,
    max_model_len: int = 0,
    served_model_name: str = "",
    default_max_tokens: int = 0,
) -> ModelLimits:
    """Limits the router validates against, from the target's config.json. The model is
    served as ``served_model_name``, by default the folder's name; ``default_max_tokens``:
    what an unset max_tokens means (0 = the room the prompt leaves, as vLLM)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    name = served_model_name or os.path.basename(os.path.normpath(model_dir))
    return ModelLimits(
        model_id=name,
        vocab_size=config["vocab_size"],
        max_model_len=max_model_len or config["max_position_embeddings"],
        num_spec_tokens=num_spec_tokens,
        default_max_tokens=default_max_tokens,
    )


def router_text(
    model_dir: str, tokenizer_path: str = "", chat_template: str = "", prompt_special_tokens: str = "text"
) -> tuple[Tokenizer, ChatTemplate | None]:
    """The model's tokenizer and chat template (see load_tokenizer, load_chat_template);
    ``prompt_special_tokens``: "parse" lets clients' text hold special tokens. Exits
    naming what is missing or malformed."""
    try:
        tokenizer = load_tokenizer(model_dir, tokenizer_path)
        tokenizer.special_in_text = prompt_special_tokens == "parse"
        return tokenizer, load_chat_template(tokenizer, chat_template)
    except ValueError as e:
        raise SystemExit(f"tandem: {e}") from None


def openai_options(
    model_dir: str,
    generation_config: str = "auto",
    reasoning_parser: str = "none",
    tool_call_parser: str = "none",
) -> OpenAIOptions:
    """The OpenAI layer's options: the sampling defaults ``generation_config`` gives
    (generation_defaults.py), the reasoning and tool-call parsers ("none" = none). Raises
    ValueError naming what is malformed."""
    defaults = load_sampling_defaults(model_dir, generation_config)
    parsers = ("" if p == "none" else p for p in (reasoning_parser, tool_call_parser))
    return OpenAIOptions(defaults, *parsers)


@dataclass(slots=True)
class RouterConfig:
    """One router process: the model it fronts, its parts' options, and where it listens.

    - ports 0 = any free port; ``http_port`` None = no OpenAI-compatible HTTP server;
    - ``tokenizer`` encodes text prompts and decodes streamed text; ``chat`` renders chat
      messages (None: chat is refused); ``openai``: the HTTP API's sampling defaults and
      reasoning parser;
    - ``process``: request lines, the stats line's interval, the shutdown timeout.
    """

    limits: ModelLimits
    options: RouterSettings = field(default_factory=RouterSettings)
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    http_port: int | None = None
    tokenizer: Tokenizer | None = None
    chat: ChatTemplate | None = None
    http_limits: HttpLimits = field(default_factory=HttpLimits)  # connections, read timeouts
    deadlines: Deadlines = field(default_factory=Deadlines)  # of the calls to workers
    openai: OpenAIOptions = field(default_factory=OpenAIOptions)
    process: ProcessSettings = field(default_factory=ProcessSettings)
    step_streams: bool = True  # workers' chunks come on Steps streams (services/router/step_links.py)


async def run_router(
    config: RouterConfig,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    bound: dict | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT), then shut down gracefully
    (shutdown.py: stop admitting, finish or cut the requests in flight within
    ``process.shutdown_timeout_s``) and close. Prints one line with the endpoints; ``bound``
    gets the ports and the RouterAPI (``router``). A busy port (gRPC, metrics, HTTP) raises
    PortInUse before anything is served."""
    c, host = config, config.host
    metrics = Metrics("router", c.limits.model_id)
    router = RouterAPI(c.limits, metrics, c.options, c.tokenizer)
    router.log_requests = c.process.log_requests
    router.cluster.deadlines = c.deadlines
    router.cluster.step_streams = c.step_streams
    opts = c.options
    server, health, port = await start_server(
        lambda s: add_router_servicers(s, router),
        host,
        c.port,
        opts.tls,
        router_policy(opts.token, opts.service_secret, opts.tls is not None),
    )
    try:
        metrics_port = serve_metrics(metrics, host, c.metrics_port)
        http, http_port = await _start_http(router, c, host)
    except PortInUse:
        await router.close()
        await server.stop(grace=None)
        raise
    await health.set("", SERVING)
    router.health_monitor.readiness = health
    http_url = f" http=http://{host}:{http_port}" if http else ""
    if http:
        log.info(
            "OpenAI API %s; reasoning parser: %s; tool-call parser: %s",
            c.openai.defaults.describe(),
            c.openai.reasoning_parser or "none",
            c.openai.tool_call_parser or "none",
        )
    print(f"router grpc={host}:{port} metrics=http://{host}:{metrics_port}/metrics{http_url}", flush=True)
    if bound is not None:
        bound.update(port=port, metrics_port=metrics_port, router=router, http_port=http_port)
    poll = asyncio.ensure_future(router.health_monitor.poll_forever())
    watch = asyncio.ensure_future(watch_loop(metrics.loop_lag.observe))
    metrics.thread_cpu.watch("event_loop")
    stats = asyncio.ensure_future(every(c.process.stats_interval_s, RouterStatsLine(router).tick))
    if ready is not None:
        ready.set()
    await wait_for_stop(stop)
    await shut_down(router, health, c.process.shutdown_timeout_s)
    poll.cancel()
    watch.cancel()
    stats.cancel()
    if http is not None:
        await http.close()
    await router.close()
    await server.stop(grace=1)


async def _start_http(
    router: RouterAPI, config: RouterConfig, host: str
) -> tuple[HttpServer | None, int | None]:
    """The OpenAI-compatible HTTP server and its port; (None, None) without ``http_port``."""
    if config.http_port is None:
        return None, None
    http = HttpServer(OpenAIServer(router, config.chat, config.openai).routes(), config.http_limits)
    return http, await http.start(host, config.http_port)
