"""deploy/options.py: one engine/worker option schema behind the `tandem` flags, the local
launcher's argv and the Ray cluster.yaml, refusing values by the option's name."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from deploy.cli import build_parser
from deploy.engine_config import engine_config
from deploy.local import STOP_MARGIN_S, LocalCluster
from deploy.option_check import check
from deploy.options import (
    HOST_WRITE_POLICIES,
    EngineOptions,
    ProcessOptions,
    TransferOptions,
    from_args,
    process_settings,
    to_argv,
)
from deploy.ray_launcher.config import ConfigError, parse_config
from kvcore import KVLayout
from kvcore.spec import HOST_WRITE_POLICIES as KVCORE_POLICIES

NON_DEFAULT = {
    "tokenizer": "/tok",
    "num_spec_tokens": 3,
    "layout": "separate",
    "dtype": "float32",
    "tokens_per_page": 4,
    "kv_cache_mb": 8,
    "host_kv_cache_mb": 16,
    "host_kv_write_policy": "through",
    "host_kv_recall_min_pages": 2,
    "max_num_seqs": 5,
    "max_model_len": 1024,
    "max_num_batched_tokens": 512,
    "prefix_cache": False,
    "unsafe_forced_acceptance": 2,
}


def _worker(argv: list[str]):
    return build_parser().parse_args(["worker", "--role", "decode", *argv])


def test_every_engine_option_is_a_flag_and_a_ray_key_with_the_same_default():
    assert from_args(EngineOptions, _worker([])) == EngineOptions()
    assert parse_config({}).model.engine_options() == EngineOptions()  # "" paths: the bundled pair
    model = parse_config({"model": NON_DEFAULT | {"tp": 2, "host_kv_cache_mb": 0}}).model
    assert {n: getattr(model, n) for n in NON_DEFAULT} == NON_DEFAULT | {"host_kv_cache_mb": 0}
    assert model.tp == 2


def test_flags_written_back_parse_to_the_same_options():
    options = dataclasses.replace(EngineOptions(), **NON_DEFAULT)
    argv = to_argv(options)
    assert "--model" not in argv and "--no-prefix-cache" in argv
    assert from_args(EngineOptions, _worker(argv)) == options


def test_the_ray_model_section_reaches_the_host_tier_and_tensor_parallelism():
    model = parse_config({"model": {"host_kv_cache_mb": 64, "host_kv_write_policy": "through"}}).model
    config = engine_config(model.engine_options())
    assert (config.host_kv_cache_bytes, config.host_kv_write_policy) == (64 << 20, "through")
    tp = engine_config(parse_config({"model": {"tp": 2, "prefix_cache": False}}).model.engine_options())
    assert (tp.tp_size, tp.enable_prefix_cache, tp.host_kv_cache_bytes) == (2, False, 0)


def test_engine_config_maps_every_option():
    config = engine_config(dataclasses.replace(EngineOptions(), **NON_DEFAULT))
    assert config.kv_cache_bytes == 8 << 20 and config.layout is KVLayout.SEPARATE
    assert (config.num_spec_tokens, config.tokens_per_page, config.max_num_seqs) == (3, 4, 5)
    assert (config.host_kv_recall_min_pages, config.tokenizer, config.dtype) == (2, "/tok", "float32")
    assert (config.max_model_len, config.max_num_batched_tokens, config.max_prefill_chunk) == (1024, 512, 512)
    assert (config.forced_acceptance, config.unsafe_forced_acceptance) == (2, True)
    assert engine_config(EngineOptions(drafter="none", layout="auto")).drafter is None


def test_the_defaults_size_as_today_on_cpu_and_from_the_gpu_on_cuda():
    cpu = engine_config(EngineOptions())
    assert (cpu.kv_cache_bytes, cpu.gpu_memory_utilization) == (256 << 20, 0.0)
    assert cpu.max_model_len == 32768  # the bundled target's max_position_embeddings
    assert (cpu.max_num_batched_tokens, cpu.max_prefill_chunk) == (0, 0)  # derived by the engine
    assert (cpu.forced_acceptance, cpu.unsafe_forced_acceptance) == (-1, False)
    assert engine_config(EngineOptions(device="cuda")).gpu_memory_utilization == 0.9
    assert (
        engine_config(EngineOptions(device="cuda:1", gpu_memory_utilization=0.5)).gpu_memory_utilization
        == 0.5
    )
    given = engine_config(EngineOptions(device="cuda", kv_cache_mb=64))
    assert (given.kv_cache_bytes, given.gpu_memory_utilization) == (64 << 20, 0.0)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"drafter": "none", "layout": "unified"}, "layout: unified keeps the drafter's KV pages"),
        ({"num_spec_tokens": 0, "layout": "unified"}, "layout: unified keeps the drafter's KV pages"),
        ({"tp": 2, "host_kv_cache_mb": 4}, "host_kv_cache_mb: the host KV tier's page copies"),
        ({"kv_cache_mb": -1}, "kv_cache_mb: must be >= 0, got -1"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization: must be in (0, 1], or 0 for the default"),
        (
            {"gpu_memory_utilization": 0.5},
            "gpu_memory_utilization: 0.5 sizes the KV cache from a CUDA device's memory; device is 'cpu'",
        ),
        (
            {"gpu_memory_utilization": 0.5, "device": "cuda", "kv_cache_mb": 64},
            "gpu_memory_utilization: 0.5 sizes the KV cache from the GPU's memory, and kv_cache_mb 64",
        ),
        ({"max_model_len": -1}, "max_model_len: must be >= 0, got -1"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens: must be >= 0, got -1"),
        ({"model": "/nowhere"}, "model: cannot read max_position_embeddings from /nowhere/config.json"),
        ({"unsafe_forced_acceptance": -2}, "unsafe_forced_acceptance: must be >= -1, got -2"),
        (
            {"unsafe_forced_acceptance": 1, "drafter": "none", "layout": "separate"},
            "unsafe_forced_acceptance: 1 forces the acceptance of drafts, and no drafter drafts here",
        ),
        (
            {"unsafe_forced_acceptance": 0, "num_spec_tokens": 0, "layout": "separate"},
            "unsafe_forced_acceptance: 0 forces the acceptance of drafts, and no drafter drafts here",
        ),
        (
            {"unsafe_forced_acceptance": 5},
            "unsafe_forced_acceptance: 5 drafts kept per step, but only num_spec_tokens 4",
        ),
        (
            {"overlap_decode": True, "drafter": "none", "layout": "separate", "tp": 2},
            "overlap_decode: overlapped steps run the CUDA graphs' path, and tp 2 runs eagerly",
        ),
        (
            {"overlap_decode": True, "device": "cuda", "drafter": "none", "cuda_graphs": False},
            "overlap_decode: overlapped steps run the CUDA graphs' path, and --enforce-eager runs every",
        ),
        ({"layout": "mixed"}, "layout: must be auto, unified or separate, got 'mixed'"),
        ({"host_kv_write_policy": "back"}, "host_kv_write_policy: must be evict or through"),
        ({"kv_cache_mb": "8"}, "kv_cache_mb: must be an integer, got '8'"),
        ({"prefix_cache": 0}, "prefix_cache: must be true or false, got 0"),
        ({"tp": 0}, "tp: must be >= 1, got 0"),
        ({"device": "tpu:x"}, "device: "),
    ],
)
def test_a_refused_option_is_named(changes, message):
    with pytest.raises(ValueError) as e:
        engine_config(dataclasses.replace(EngineOptions(), **changes))
    assert str(e.value).startswith(message)


def test_the_ray_config_refuses_by_section_and_option_before_placing_anything():
    for data, message in [
        ({"model": {"tp": 2, "host_kv_cache_mb": 4}}, "model.host_kv_cache_mb: "),
        (
            {"model": {"unsafe_forced_acceptance": 2, "drafter": "none", "layout": "separate"}},
            "model.unsafe_forced_acceptance: 2 forces",
        ),
        ({"model": {"drafter": "none", "layout": "unified"}}, "model.layout: unified keeps"),
        ({"decode": {"lease_s": 0}}, "decode.lease_s: must be > 0, got 0"),
        ({"prefill": {"transfer_timeout_s": "soon"}}, "prefill.transfer_timeout_s: must be a number"),
    ]:
        with pytest.raises(ConfigError) as e:
            parse_config(data)
        assert str(e.value).startswith(message)
    assert parse_config({"prefill": {"lease_s": 5}}).prefill.lease_s == 5


def test_the_cli_refuses_a_bad_value_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        _worker(["--kv-cache-mb", "-1"])
    assert "argument --kv-cache-mb: must be >= 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _worker(["--gpu-memory-utilization", "2"])
    assert "argument --gpu-memory-utilization: must be in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _worker(["--log-level", "LOUD"])
    assert "argument --log-level: invalid choice: 'LOUD'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _worker(["--lease-s", "-1"])
    assert "argument --lease-s: must be > 0" in capsys.readouterr().err


def test_the_worker_takes_the_transfer_options():
    args = _worker(["--transfer-timeout-s", "5", "--lease-s", "7"])
    assert from_args(TransferOptions, args) == TransferOptions(5.0, 7.0)
    check(TransferOptions())


def test_up_gives_the_workers_every_engine_flag_and_each_role_its_tp():
    args = build_parser().parse_args(["up", "--kv-cache-mb", "32", "--tp", "2", "--decode-tp", "1"])
    cluster = LocalCluster.from_args(args)
    assert cluster.worker_args == ["--kv-cache-mb", "32"]
    assert cluster.extra == [["--tp", "2"], ["--tp", "1"]]
    assert cluster.router_args == []


SIZING = ["--max-model-len", "1024", "--max-num-batched-tokens", "512", "--max-num-seqs", "8"]
UNSAFE = ["--unsafe-forced-acceptance", "1"]


def test_up_gives_the_workers_the_sizing_flags_and_forced_acceptance_and_the_router_its_limit():
    args = build_parser().parse_args(
        ["up", *SIZING, "--gpu-memory-utilization", "0.8", "--device", "cuda", *UNSAFE]
    )
    cluster = LocalCluster.from_args(args)
    worker = from_args(EngineOptions, _worker([*cluster.worker_args, *cluster.extra[0]]))
    assert (worker.max_model_len, worker.max_num_batched_tokens, worker.max_num_seqs) == (1024, 512, 8)
    assert (worker.gpu_memory_utilization, worker.unsafe_forced_acceptance) == (0.8, 1)
    assert cluster.router_args == ["--max-model-len", "1024"]
    router = build_parser().parse_args(["router", *cluster.router_args])
    assert router.max_model_len == 1024


def test_up_gives_every_process_its_log_level():
    cluster = LocalCluster.from_args(build_parser().parse_args(["up", "--log-level", "ERROR"]))
    assert cluster.router_args == ["--log-level", "ERROR"] and cluster.worker_args == ["--log-level", "ERROR"]
    assert _worker(cluster.worker_args).log_level == "ERROR"
    default = LocalCluster.from_args(build_parser().parse_args(["up"]))
    assert default.router_args == default.worker_args == []  # INFO, each process's default


def test_the_ray_config_reaches_the_sizing_options_and_the_log_level():
    config = parse_config(
        {"model": {"max_model_len": 1024, "max_num_batched_tokens": 512, "unsafe_forced_acceptance": 1}}
    )
    engine = engine_config(config.worker_engine_options("decode"))
    assert (engine.max_model_len, engine.max_num_batched_tokens, engine.forced_acceptance) == (1024, 512, 1)
    assert parse_config({"log_level": "DEBUG"}).log_level == "DEBUG"
    assert parse_config({}).log_level == "INFO"
    with pytest.raises(ConfigError, match=r"^log_level: must be DEBUG, INFO, WARNING or ERROR, got 'LOUD'"):
        parse_config({"log_level": "LOUD"})


def test_ray_workers_that_share_a_gpu_split_the_default_fraction():
    cuda = {"device": "cuda"}
    half = parse_config({"model": cuda, "prefill": {"num_gpus": 0.5}, "decode": {"num_gpus": 1}})
    assert half.worker_engine_options("prefill").gpu_memory_utilization == 0.45
    assert engine_config(half.worker_engine_options("decode")).gpu_memory_utilization == 0.9
    tp = parse_config({"model": cuda | {"tp": 2}, "prefill": {"num_gpus": 1}})
    assert tp.worker_engine_options("prefill").gpu_memory_utilization == 0.45  # 2 ranks on 1 GPU
    given = parse_config({"model": cuda | {"gpu_memory_utilization": 0.3}, "prefill": {"num_gpus": 0.5}})
    assert given.worker_engine_options("prefill").gpu_memory_utilization == 0.3  # each worker's own
    sized = parse_config({"model": cuda | {"kv_cache_mb": 512}, "prefill": {"num_gpus": 0.5}})
    assert engine_config(sized.worker_engine_options("prefill")).gpu_memory_utilization == 0.0
    with pytest.raises(
        ConfigError, match=r"^model\.gpu_memory_utilization: 0.5 sizes the KV cache from a CUDA"
    ):
        parse_config({"model": {"gpu_memory_utilization": 0.5}})  # on the CPU


def test_host_write_policies_are_kvcores():
    assert HOST_WRITE_POLICIES == KVCORE_POLICIES


def test_the_options_and_the_ray_config_load_no_torch():
    code = "import sys, deploy.options, deploy.ray_launcher.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_ray_takes_prompt_special_tokens_and_refuses_another_value():
    assert parse_config({"model": {"prompt_special_tokens": "parse"}}).model.prompt_special_tokens == "parse"
    assert parse_config({}).model.prompt_special_tokens == "text"
    with pytest.raises(ConfigError, match=r"^model\.prompt_special_tokens: must be text or parse, got 'yes'"):
        parse_config({"model": {"prompt_special_tokens": "yes"}})


def test_up_gives_every_process_its_log_format_request_and_stats_lines_and_shutdown_timeout():
    flags = [
        "--log-format",
        "json",
        "--disable-log-requests",
        "--log-stats-interval-s",
        "0",
        "--shutdown-timeout-s",
        "5",
    ]
    cluster = LocalCluster.from_args(build_parser().parse_args(["up", *flags]))
    assert cluster.router_args == cluster.worker_args == [*flags[:4], "0.0", flags[5], "5.0"]
    assert cluster.stop_wait_s == 5 + STOP_MARGIN_S and cluster.own_group
    for command in (["router"], ["worker", "--role", "decode"]):
        args = build_parser().parse_args([*command, *flags])
        settings = process_settings(from_args(ProcessOptions, args))
        assert args.log_format == "json"
        assert (settings.log_requests, settings.stats_interval_s, settings.shutdown_timeout_s) == (
            False,
            0,
            5,
        )
    default = process_settings(from_args(ProcessOptions, build_parser().parse_args(["router"])))
    assert (default.log_requests, default.stats_interval_s, default.shutdown_timeout_s) == (True, 10, 30)


def test_a_negative_stats_interval_or_shutdown_timeout_is_refused(capsys):
    for flag in ("--log-stats-interval-s", "--shutdown-timeout-s"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["router", flag, "-1"])
        assert flag in capsys.readouterr().err
