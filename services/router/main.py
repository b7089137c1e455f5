"""Running the router process."""

from __future__ import annotations

import asyncio
import json
import os

from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import registration_pb2_grpc as reg_grpc
from services.common.grpc_server import SERVING, start_server
from services.common.metrics import Metrics, serve_metrics
from services.common.security import TlsConfig
from services.common.serve import _wait_for_stop
from services.router.chat_template import ChatTemplate, load_chat_template
from services.router.http import HttpServer
from services.router.openai_api import OpenAIServer
from services.router.server import STATS_MISSES, STATS_TIMEOUT_S, ModelLimits, Router
from tokenization.tokenizer import Tokenizer, load_tokenizer


def model_limits(
    model_dir: str, num_spec_tokens: int, max_model_len: int = 0, served_model_name: str = ""
) -> ModelLimits:
    """Limits the router validates against, from the target's config.json. The model is
    served as ``served_model_name``, by default the folder's name."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    name = served_model_name or os.path.basename(os.path.normpath(model_dir))
    return ModelLimits(
        model_id=name,
        vocab_size=config["vocab_size"],
        max_model_len=max_model_len or config["max_position_embeddings"],
        num_spec_tokens=num_spec_tokens,
    )


def router_text(
    model_dir: str, tokenizer_path: str = "", chat_template: str = ""
) -> tuple[Tokenizer, ChatTemplate | None]:
    """The model's tokenizer and chat template (see load_tokenizer, load_chat_template);
    exits naming what is missing or malformed."""
    try:
        tokenizer = load_tokenizer(model_dir, tokenizer_path)
        return tokenizer, load_chat_template(tokenizer, chat_template)
    except ValueError as e:
        raise SystemExit(f"tandem: {e}") from None


async def run_router(
    limits: ModelLimits,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int = 0,
    tokens_per_page: int = 16,
    token: str = "",
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    bound: dict | None = None,
    http_port: int | None = None,
    tls: TlsConfig | None = None,
    health_timeout_s: float = STATS_TIMEOUT_S,
    health_misses: int = STATS_MISSES,
    tokenizer: Tokenizer | None = None,
    chat: ChatTemplate | None = None,
) -> None:
    """Serve until ``stop`` is set. Ports: 0 = any free port; ``http_port`` None = no
    OpenAI-compatible HTTP server. A worker that misses ``health_misses`` Stats polls in a
    row (``health_timeout_s`` each) gets no traffic. ``tokenizer`` encodes text prompts and
    decodes streamed text; ``chat`` renders chat messages (None: chat is refused). Prints
    one line with the endpoints."""
    metrics = Metrics("router", limits.model_id)
    router = Router(limits, metrics, tokens_per_page, token, tls, tokenizer)
    router.stats_timeout_s, router.stats_misses = health_timeout_s, health_misses

    def add(server) -> None:
        cpb_grpc.add_TandemServicer_to_server(router, server)
        reg_grpc.add_RegistrationServicer_to_server(router, server)

    server, health, port = await start_server(add, host, port, tls, token)
    metrics_port = serve_metrics(metrics, host, metrics_port)
    http = HttpServer(OpenAIServer(router, chat).routes()) if http_port is not None else None
    if http is not None:
        http_port = await http.start(host, http_port)
    await health.set("", SERVING)
    router.health = health
    print(
        f"router grpc={host}:{port} metrics=http://{host}:{metrics_port}/metrics"
        + (f" http=http://{host}:{http_port}" if http else ""),
        flush=True,
    )
    if bound is not None:
        bound.update(
            port=port, metrics_port=metrics_port, router=router, http_port=http_port if http else None
        )
    poll = asyncio.ensure_future(router.poll_stats())
    if ready is not None:
        ready.set()
    await _wait_for_stop(stop)
    poll.cancel()
    if http is not None:
        await http.close()
    await router.close()
    await server.stop(grace=1)
