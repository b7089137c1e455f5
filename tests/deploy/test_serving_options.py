"""The serving options of `tandem up` / `router` / `worker` (tokenizer, chat template, served
model name): parsed, passed on by the local launcher, and applied by the router."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from deploy.cli import build_parser
from deploy.local import LocalCluster
from deploy.options import RouterOptions, from_args, router_deadlines, router_http_limits, served_model_name
from deploy.ray_launcher.config import ConfigError, parse_config
from services.common.metrics import Metrics
from services.router.api import RouterAPI
from services.router.cluster import Deadlines
from services.router.generation_defaults import SamplingDefaults
from services.router.http import HttpLimits, ReadTimeouts
from services.router.main import model_limits, openai_options, router_text
from services.router.openai_api import OpenAIOptions, OpenAIServer

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-target"
OPTIONS = ["--tokenizer", "/tok", "--chat-template", "/chat.jinja", "--served-model-name", "m"]


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_up_help_shows_the_serving_options():
    text = build_parser()._subparsers._group_actions[0].choices["up"].format_help()
    for flag in ("--tokenizer", "--chat-template", "--served-model-name"):
        assert flag in text


def test_up_passes_them_to_the_router_and_the_workers_their_part():
    args = build_parser().parse_args(["up", *OPTIONS])
    cluster = LocalCluster.from_args(args)
    router, worker = cluster.router_args, cluster.worker_args
    assert [_value(router, f) for f in OPTIONS[::2]] == ["/tok", "/chat.jinja", "m"]
    assert [_value(worker, f) for f in OPTIONS[::2]] == ["/tok", None, "m"]
    plain = LocalCluster.from_args(build_parser().parse_args(["up"]))
    assert "--tokenizer" not in plain.router_args + plain.worker_args


def test_the_served_name_defaults_to_the_model_folder():
    args = build_parser().parse_args(["router", "--model", str(TINY)])
    assert served_model_name(args.model, args.served_model_name) == "tiny-target"
    assert model_limits(str(TINY), 4, served_model_name="").model_id == "tiny-target"
    assert model_limits(str(TINY), 4, served_model_name="m").model_id == "m"


def test_the_router_serves_the_name_and_labels_its_metrics_with_it():
    limits = model_limits(str(TINY), 4, served_model_name="my-model")
    tokenizer, chat = router_text(str(TINY))
    metrics = Metrics("router", limits.model_id)
    router = RouterAPI(limits, metrics, tokenizer=tokenizer)
    info = asyncio.run(router.model_info())
    assert info.model_id == "my-model"
    server = OpenAIServer(router, chat)
    response = asyncio.run(server.models(None))
    assert json.loads(response.body)["data"][0]["id"] == "my-model"
    metrics.requests.labels("router", "stop").inc()
    text = generate_latest(metrics.registry).decode()
    assert 'tandem_requests_total{model_name="my-model",role="router",status="stop"} 1.0' in text


def test_a_router_without_a_tokenizer_exits_naming_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    try:
        router_text(str(tmp_path))
    except SystemExit as e:
        assert str(e).startswith(f"tandem: model: {str(tmp_path)!r} has no tokenizer.json")
    else:
        raise AssertionError("no exit")


def test_the_ray_config_takes_the_serving_options():
    config = parse_config(
        {"model": {"tokenizer": "tok", "chat_template": "chat.jinja", "served_model_name": "m"}}
    )
    engine = config.model.engine_options()
    assert engine.tokenizer.endswith("/tok") and config.model.chat_template_path.endswith("/chat.jinja")
    assert served_model_name(engine.model, config.model.served_model_name) == "m"
    default = parse_config({}).model
    name = served_model_name(default.engine_options().model, default.served_model_name)
    assert (default.engine_options().tokenizer, default.chat_template_path, name) == ("", "", "tiny-target")


def http_limits(args):
    return router_http_limits(from_args(RouterOptions, args))


def deadlines(args):
    return router_deadlines(from_args(RouterOptions, args))


def test_the_routers_http_limits_default_to_the_servers_and_take_their_flags():
    plain = build_parser().parse_args(["router", "--model", str(TINY)])
    assert http_limits(plain) == HttpLimits()
    flags = ["--http-max-connections", "8", "--http-header-timeout-s", "2", "--http-body-timeout-s", "5.5"]
    args = build_parser().parse_args(["router", "--model", str(TINY), *flags])
    assert http_limits(args) == HttpLimits(8, ReadTimeouts(2.0, 5.5))


def test_the_routers_deadlines_default_to_the_clusters_and_take_their_flags():
    plain = build_parser().parse_args(["router", "--model", str(TINY)])
    assert deadlines(plain) == Deadlines()
    flags = ["--worker-call-timeout-s", "3", "--prefill-timeout-s", "40", "--stream-idle-timeout-s", "9"]
    flags += ["--prefill-timeout-per-1k-tokens-s", "2.5"]
    args = build_parser().parse_args(["router", "--model", str(TINY), *flags])
    assert deadlines(args) == Deadlines(call_s=3.0, prefill_s=40.0, stream_idle_s=9.0, prefill_per_1k_s=2.5)
    assert deadlines(args).prefill_for(4000) == 50.0


def test_up_gives_the_router_its_sampling_defaults_and_reasoning_parser_and_the_workers_neither():
    args = build_parser().parse_args(["up", "--generation-config", "vllm", "--reasoning-parser", "qwen3"])
    cluster = LocalCluster.from_args(args)
    router, worker = cluster.router_args, cluster.worker_args
    assert (_value(router, "--generation-config"), _value(router, "--reasoning-parser")) == ("vllm", "qwen3")
    assert "--generation-config" not in worker and "--reasoning-parser" not in worker
    plain = LocalCluster.from_args(build_parser().parse_args(["up"]))
    assert "--generation-config" not in plain.router_args  # auto, the router's default


def test_the_router_takes_them_and_defaults_to_the_folders_file_and_no_parser():
    flags = ["--generation-config", "vllm", "--reasoning-parser", "deepseek_r1"]
    args = build_parser().parse_args(["router", "--model", str(TINY), *flags])
    options = openai_options(args.model, args.generation_config, args.reasoning_parser)
    assert options == OpenAIOptions(SamplingDefaults(source="--generation-config vllm"), "deepseek_r1")
    plain = build_parser().parse_args(["router", "--model", str(TINY)])
    options = openai_options(plain.model, plain.generation_config, plain.reasoning_parser)
    assert options == OpenAIOptions(SamplingDefaults(source="generation_config.json"), "")  # no sampling keys
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--reasoning-parser", "mine"])


def test_the_ray_config_takes_them():
    model = parse_config({"model": {"generation_config": "vllm", "reasoning_parser": "qwen3"}}).model
    assert (model.generation_config_path, model.reasoning_parser) == ("vllm", "qwen3")
    assert parse_config({}).model.generation_config_path == "auto"
    with pytest.raises(ConfigError, match="^model.reasoning_parser: must be one of"):
        parse_config({"model": {"reasoning_parser": "mine"}})


def test_the_tool_call_parser_reaches_the_router_only_from_every_launcher():
    args = build_parser().parse_args(["up", "--tool-call-parser", "hermes"])
    cluster = LocalCluster.from_args(args)
    assert _value(cluster.router_args, "--tool-call-parser") == "hermes"
    assert "--tool-call-parser" not in cluster.worker_args
    router = build_parser().parse_args(["router", "--model", str(TINY), "--tool-call-parser", "llama3_json"])
    options = openai_options(router.model, "vllm", "none", router.tool_call_parser)
    assert (options.reasoning_parser, options.tool_call_parser) == ("", "llama3_json")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--tool-call-parser", "mine"])
    assert parse_config({"model": {"tool_call_parser": "mistral"}}).model.tool_call_parser == "mistral"
    with pytest.raises(ConfigError, match="^model.tool_call_parser: must be one of"):
        parse_config({"model": {"tool_call_parser": "mine"}})
