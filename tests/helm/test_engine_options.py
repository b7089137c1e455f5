"""Every engine option reaches the workers through the chart: each field of EngineOptions has a
chart value (but the benchmarks-only forced acceptance, which the chart refuses), and the chart
with every one of them off its default renders the command lines that the real `tandem` parser
reads back as those options (issue 16, one option set)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import pytest
import yaml

from deploy.options import ROUTER_ENGINE_OPTIONS, EngineOptions, from_args
from tests.helm.chart import CHART, effective_args, render
from tests.helm.test_cli_parses_the_chart import parse

WORKERS = ("prefill", "decode")
MOUNT = "/mnt/weights"  # model.mountPath of the PVC the model folders are read from
HOST_FLAGS = ("--host-kv-cache-mb", "--host-kv-write-policy", "--host-kv-recall-min-pages")


class ChartValue(NamedTuple):
    """Where an option is set in the values (``{role}``: each worker role's own), what it is set
    to there (by role for a role's own) and the option the worker should then get."""

    path: str
    value: Any
    option: Any = None  # None: the value itself


def by_role(prefill: Any, decode: Any) -> dict[str, Any]:
    return {"prefill": prefill, "decode": decode}


# EngineOptions field -> its chart value. A new option without an entry fails
# test_every_engine_option_has_a_chart_value: give it a value in the chart, then here.
CHART_VALUES: dict[str, ChartValue] = {
    "model": ChartValue("model.target", "llama-8b", f"{MOUNT}/llama-8b"),
    "drafter": ChartValue("model.drafter", "llama-1b", f"{MOUNT}/llama-1b"),
    "tokenizer": ChartValue("model.tokenizer", "tokenizers/llama", f"{MOUNT}/tokenizers/llama"),
    "num_spec_tokens": ChartValue("engine.numSpecTokens", 6),
    "layout": ChartValue("engine.layout", "separate"),
    "device": ChartValue("engine.device", "cuda"),
    "dtype": ChartValue("engine.dtype", "float16"),
    "tokens_per_page": ChartValue("engine.tokensPerPage", 32),
    "kv_cache_mb": ChartValue("{role}.kvCacheMb", by_role(12288, 24576)),
    "gpu_memory_utilization": ChartValue("{role}.gpuMemoryUtilization", by_role(0.85, 0.8)),
    "max_model_len": ChartValue("engine.maxModelLen", 4096),
    "max_num_batched_tokens": ChartValue("engine.maxNumBatchedTokens", 4096),
    "scheduling_policy": ChartValue("engine.schedulingPolicy", "prefill-first"),
    "host_kv_cache_mb": ChartValue("{role}.hostKvCache.mb", by_role(2048, 4096)),
    "host_kv_write_policy": ChartValue("{role}.hostKvCache.writePolicy", by_role("through", "through")),
    "host_kv_recall_min_pages": ChartValue("{role}.hostKvCache.recallMinPages", by_role(3, 5)),
    "max_num_seqs": ChartValue("engine.maxNumSeqs", 128),
    "stream_interval": ChartValue("engine.streamInterval", 8),
    "prefix_cache": ChartValue("engine.prefixCache", False),
    "cuda_graphs": ChartValue("engine.cudaGraphs", False),
    "adaptive_k": ChartValue("engine.adaptiveK", False),
    "overlap_decode": ChartValue("engine.overlapDecode", True),
    "quantization": ChartValue("engine.quantization", "fp8"),
    "draft_quantization": ChartValue("engine.draftQuantization", "fp8"),
    "tp": ChartValue("{role}.tp", by_role(2, 4)),
}
# Options the chart refuses (tests/helm/test_value_sets.py shows how), at their defaults here.
CHART_REFUSED = ("unsafe_forced_acceptance",)
# The chart, like the worker, refuses the host tier with tp > 1, and the KV size given both
# ways, so each role has one of each pair at its default in each render; the renders swap them.
CONFLICTING = (("tp", "host_kv_cache_mb"), ("kv_cache_mb", "gpu_memory_utilization"))
PREFILL_TP = {"host_kv_cache_mb", "gpu_memory_utilization"}
RENDERS = {  # the fields each role leaves at their defaults
    "prefill-tp": by_role(PREFILL_TP, {"tp", "kv_cache_mb"}),
    "decode-tp": by_role({"tp", "kv_cache_mb"}, PREFILL_TP),
}
FIELDS = {f.name: f for f in dataclasses.fields(EngineOptions)}


def option(name: str, role: str) -> Any:
    v = CHART_VALUES[name]
    value = v.value[role] if "{role}" in v.path else v.value
    return value if v.option is None else v.option


def expected(role: str, render_name: str) -> EngineOptions:
    """What ``role`` should run with in the render ``render_name``."""
    left = RENDERS[render_name][role] | set(CHART_REFUSED)
    return EngineOptions(**{n: FIELDS[n].default if n in left else option(n, role) for n in FIELDS})


def values(render_name: str) -> dict:
    """The chart values of the render ``render_name``: every option off its default, but the
    one per role that RENDERS leaves."""
    out: dict = {"model": {"source": "pvc", "mountPath": MOUNT, "pvc": {"claimName": "weights"}}}
    for name, v in CHART_VALUES.items():
        for role in WORKERS if "{role}" in v.path else (None,):
            if role and name in RENDERS[render_name][role]:
                continue
            *parents, key = v.path.format(role=role).split(".")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
            node[key] = v.value[role] if role else v.value
    return out


def test_every_engine_option_has_a_chart_value_off_its_default():
    assert sorted(CHART_VALUES) == sorted(set(FIELDS) - set(CHART_REFUSED))
    for name in CHART_VALUES:
        for role in WORKERS:
            assert option(name, role) != FIELDS[name].default, f"{name}: the test must set it off its default"
    for role in WORKERS:  # each role runs every option off its default in one render or the other
        off = {n for r in RENDERS for n in FIELDS if getattr(expected(role, r), n) != FIELDS[n].default}
        assert off == set(CHART_VALUES), role
        for pair in CONFLICTING:  # one of each pair left in each render
            assert all(len(RENDERS[r][role] & set(pair)) == 1 for r in RENDERS), (role, pair)


@pytest.mark.parametrize("render_name", sorted(RENDERS))
@pytest.mark.parametrize("role", WORKERS)
def test_each_worker_role_runs_every_option_set_in_the_chart(role, render_name, monkeypatch):
    args = parse(render(values(render_name)), role, monkeypatch)
    assert args.command == "worker" and args.role == role
    assert from_args(EngineOptions, args) == expected(role, render_name)


@pytest.mark.parametrize("render_name", sorted(RENDERS))
def test_the_router_runs_its_engine_options_set_in_the_chart(render_name, monkeypatch):
    args = parse(render(values(render_name)), "router", monkeypatch)
    assert args.command == "router"
    want = expected("decode", render_name)  # the router's options are the cluster's, not a role's
    assert {n: getattr(args, n) for n in ROUTER_ENGINE_OPTIONS} == {
        n: getattr(want, n) for n in ROUTER_ENGINE_OPTIONS
    }
    assert all(option(n, "prefill") == option(n, "decode") for n in ROUTER_ENGINE_OPTIONS)


def test_the_chart_defaults_are_the_options_defaults_where_it_passes_no_flag():
    """The workers get the host tier flags, --no-prefix-cache, --tp and the KV size flags only
    off the options' defaults, so the chart's defaults for them must be those defaults; the
    sizing values it always passes default to the options' defaults too."""
    with open(f"{CHART}/values.yaml") as f:
        chart = yaml.safe_load(f)
    d = {n: f.default for n, f in FIELDS.items()}
    e = chart["engine"]
    assert (e["prefixCache"], e["tp"]) == (d["prefix_cache"], d["tp"])
    assert (e["maxNumSeqs"], e["streamInterval"], e["maxNumBatchedTokens"], e["maxModelLen"]) == (
        d["max_num_seqs"],
        d["stream_interval"],
        d["max_num_batched_tokens"],
        d["max_model_len"],
    )
    for role in WORKERS:
        host = chart[role]["hostKvCache"]
        assert (host["mb"], host["writePolicy"], host["recallMinPages"]) == (
            d["host_kv_cache_mb"],
            d["host_kv_write_policy"],
            d["host_kv_recall_min_pages"],
        )
        assert (chart[role]["kvCacheMb"], chart[role]["gpuMemoryUtilization"]) == (d["kv_cache_mb"], None)
    m = render()
    skipped = (*HOST_FLAGS, "--no-prefix-cache", "--tp", "--kv-cache-mb", "--gpu-memory-utilization")
    for role in WORKERS:
        args = effective_args(m, role)
        assert not [a for a in args if a in skipped], role


def test_each_host_tier_flag_is_passed_only_off_its_default():
    m = render({"decode": {"hostKvCache": {"mb": 1024}}, "prefill": {"hostKvCache": {"recallMinPages": 2}}})
    assert [a for a in effective_args(m, "decode") if a in HOST_FLAGS] == ["--host-kv-cache-mb"]
    assert [a for a in effective_args(m, "prefill") if a in HOST_FLAGS] == ["--host-kv-recall-min-pages"]
