"""The engine and worker options every launcher takes, defined once.

Each option is a field of a dataclass below: its name is the Ray cluster.yaml key (under
``model:``, or a worker role for ``TransferOptions``), ``--`` plus the name in kebab case is
its ``tandem`` flag (``add_engine_args``), and the Helm values map onto the same flags.
``deploy.option_check.check`` refuses a bad value with a ValueError that starts with the
option's name, without loading torch; ``deploy.engine_config`` is the one place the options
become an ``EngineConfig``.
``RouterOptions`` are the router's own (deadlines, health polling, HTTP limits); they
become its parts' configs in ``router_deadlines`` and ``router_http_limits``.

Units: ``*_mb`` are MiB, ``*_s`` seconds. Paths are taken as given (launchers resolve them).
The flags themselves are deploy/option_flags.py's, the value rules deploy/option_rules.py's.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from deploy.option_flags import add_args
from deploy.option_flags import from_args as from_args  # re-exported: the launchers' one import
from deploy.option_flags import positive_float as positive_float
from deploy.option_flags import positive_int as positive_int
from deploy.option_flags import to_argv as to_argv
from deploy.option_rules import (
    Rule,
    at_least,
    fraction_or_zero,
    positive,
)
from services.common.log_setup import LOG_FORMATS, LOG_LEVELS
from services.common.process_settings import ProcessSettings
from services.router.cluster import Deadlines
from services.router.http import HttpLimits, ReadTimeouts

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the Tandem source tree
DEFAULT_MODEL = os.path.join(HERE, "models", "tiny-target")
DEFAULT_DRAFTER = os.path.join(HERE, "models", "tiny-drafter")
LAYOUTS = ("auto", "unified", "separate")
DRAFT_QUANTIZATIONS = ("none", "fp8")
QUANTIZATIONS = ("none", "fp8")
HOST_WRITE_POLICIES = ("evict", "through")  # kvcore.spec's (a module that loads torch)
PROMPT_SPECIAL_TOKENS = ("text", "parse")
REASONING_PARSERS = ("none", "qwen3", "deepseek_r1")  # services.router.reasoning.PARSERS, and none
TOOL_CALL_PARSERS = ("none", "hermes", "llama3_json", "mistral")  # services.router.tool_calls.PARSERS
# serving options workers do not take
ROUTER_ONLY_SERVING = (
    "chat_template",
    "prompt_special_tokens",
    "generation_config",
    "reasoning_parser",
    "tool_call_parser",
)
# what the router takes of the engine options: its limits, its text, its page hashing
ROUTER_ENGINE_OPTIONS = ("model", "tokenizer", "num_spec_tokens", "tokens_per_page", "max_model_len")
CPU_KV_CACHE_MB = 256  # the KV cache off CUDA when --kv-cache-mb is not given
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # of a CUDA device's memory, when not given (as vLLM's)


def _option(
    default: Any,
    help: str,
    rule: Rule | None = None,
    flags: tuple[str, ...] = (),
    choices: tuple[str, ...] = (),
) -> Any:
    """A dataclass field carrying its flag's help, its value rule or choices and, when the
    flag is not ``--<name>``, its flags."""
    return field(default=default, metadata={"help": help, "rule": rule, "flags": flags, "choices": choices})


@dataclass(slots=True)
class EngineOptions:
    """What ``tandem up|worker|generate`` take as engine flags."""

    model: str = _option(
        DEFAULT_MODEL, "target model folder (config.json + *.safetensors); default: the bundled tiny target"
    )
    drafter: str = _option(DEFAULT_DRAFTER, "drafter folder; 'none' = no drafter")
    tokenizer: str = _option(
        "",
        "Hugging Face tokenizer: a folder with tokenizer.json (and tokenizer_config.json), "
        "or a tokenizer.json; default: the model folder's own",
    )
    num_spec_tokens: int = _option(4, "draft tokens per step (K)", at_least(0), ("-k", "--num-spec-tokens"))
    layout: str = _option(
        "auto",
        "unified: the drafter's KV lives and moves with the target's; separate: the baseline "
        "(draft KV neither cached nor transferred); auto: unified when there is a drafter",
        choices=LAYOUTS,
    )
    device: str = _option("cpu", "torch device (default: cpu)")
    dtype: str = _option("", "KV/model dtype; default float32 on CPU, bf16 on CUDA")
    tokens_per_page: int = _option(16, "KV page size in tokens; every worker must agree", at_least(1))
    kv_cache_mb: int = _option(
        0,
        "KV memory per worker, MiB, all layer groups; default 0 = derived: from "
        f"--gpu-memory-utilization on CUDA, {CPU_KV_CACHE_MB} MiB elsewhere",
        at_least(0),
    )
    gpu_memory_utilization: float = _option(
        0.0,
        "CUDA only: the fraction of the GPU's total memory this worker may use; its KV cache gets "
        "what is left of it after the weights, the peak activations of a profile forward at "
        "--max-num-batched-tokens and the CUDA graphs (as vLLM's); default 0 = "
        f"{DEFAULT_GPU_MEMORY_UTILIZATION}, which `tandem up` splits evenly among the workers it "
        "places on one GPU; give it or --kv-cache-mb",
        fraction_or_zero,
    )
    max_model_len: int = _option(
        0,
        "tokens of one request, prompt plus completion; a worker refuses to start when its KV "
        "cache cannot hold one request this long; default 0 = the model's max_position_embeddings",
        at_least(0),
    )
    max_num_batched_tokens: int = _option(
        0,
        "tokens one engine step runs: a decode step's K + 1 per request, then prompt chunks up to "
        "this budget (one prompt's chunk may take all of it, as in vLLM's chunked prefill); "
        "default 0 = derived: on CUDA a step of about the prompt work of 2048 tokens of an 8B "
        "model per GPU (2048 for an 8B, up to 8192 for small models), 2048 elsewhere",
        at_least(0),
    )
    scheduling_policy: str = _option(
        "auto",
        "how a step's decode rows and prompt chunks share the target: mixed = one forward (the "
        "decode rows ride on the prompt's weight reads, as vLLM's chunked prefill); decode-first / "
        "prefill-first = two forwards in that order; auto = decode-first on CPU (its attention pads "
        "every query block to the longest) and with a drafter whose steps replay CUDA graphs (a "
        "mixed step would run the drafting eagerly), else mixed",
        choices=("auto", "mixed", "decode-first", "prefill-first"),
    )
    host_kv_cache_mb: int = _option(
        0,
        "host-memory tier under the prefix cache, MiB (evicted pages are kept there and recalled); 0 = none",
        at_least(0),
    )
    host_kv_write_policy: str = _option(
        "evict",
        "when a cached page is copied to the host tier: evict = as it leaves device memory "
        "(write-back); through = as it enters the prefix cache (write-through: evictions copy nothing)",
        choices=HOST_WRITE_POLICIES,
    )
    host_kv_recall_min_pages: int = _option(
        1,
        "recall a host-tier hit only if it is at least this many pages; shorter ones are recomputed",
        at_least(1),
    )
    max_num_seqs: int = _option(64, "requests a worker batches at once", at_least(1))
    stream_interval: int = _option(
        1,
        "tokens a running request's output gathers before the worker streams it (its first token "
        "goes at once, its last with the finish): larger values write fewer messages per step, for "
        "throughput at high concurrency, at the cost of burstier streams (as vLLM's and SGLang's "
        "--stream-interval); a prefill worker streams nothing",
        at_least(1),
    )
    prefix_cache: bool = _option(True, "turn the radix prefix cache off", flags=("--no-prefix-cache",))
    cuda_graphs: bool = _option(
        True, "run the decode step eagerly, without CUDA graphs (as vLLM's)", flags=("--enforce-eager",)
    )
    adaptive_k: bool = _option(
        True,
        "draft K tokens every step; by default, with CUDA graphs, a step of greedy requests drafts "
        "only when its measured cost pays for the running acceptance (fixed K: measuring AL)",
        flags=("--no-adaptive-k",),
    )
    overlap_decode: bool = _option(
        False,
        "launch each decode step before the previous one is read, so the host's bookkeeping runs "
        "beside the GPU's work (as vLLM's async scheduling and SGLang's overlap scheduler): decode "
        "steps replaying CUDA graphs, with tp 1, target-only or drafting the full K; batches with "
        "penalties or a grammar run synchronously. On a CPU the same path runs uncaptured, with "
        "nothing beside the host to overlap (slower: a way to run the path without a GPU)",
    )
    quantization: str = _option(
        "none",
        "fp8: the target's linear weights quantized at load to e4m3 with a scale per output "
        "channel, activations per token at run time (as a published FP8-Dynamic folder; the "
        "embedding and LM head stay in the model's dtype). A folder that ships FP8 weights "
        "loads as its quantization_config says either way",
        choices=QUANTIZATIONS,
    )
    draft_quantization: str = _option(
        "none",
        "fp8: the drafter's own weights (fc, its layers, its LM head) also in e4m3 with a scale "
        "per row, read by its one-row matmuls (half the bytes per draft at batch 1; larger ones "
        "read the weight as loaded: the drafter takes 1.5x its memory); verification stays in "
        "the target's dtype, so greedy output is unchanged, but acceptance may drop",
        choices=DRAFT_QUANTIZATIONS,
    )
    tp: int = _option(
        1,
        "tensor-parallel ranks per worker, one process each (gloo on CPU, NCCL on GPU: rank r "
        "takes GPU r of --device)",
        at_least(1),
    )
    unsafe_forced_acceptance: int = _option(
        -1,
        "BENCHMARKS ONLY: the verifier keeps exactly N drafts per step whatever the target says, so "
        "AL is forced to N + 1 and outputs are NOT the target's; the workers say so at start, in "
        "their RankInfo, the router's ModelInfo and /v1/models; needs a drafter and N <= K; "
        "default -1 = off",
        at_least(-1),
    )


@dataclass(slots=True)
class ProcessOptions:
    """What every Tandem process takes, whatever its role: the router, the workers (and
    their TP ranks), and ``tandem up``, which passes it on to the processes it starts."""

    log_level: str = _option(
        "INFO",
        "the least severe Python logging level printed (to stderr, one line each: time, level, "
        "the process, the logger, the request's id when the line is about one)",
        choices=LOG_LEVELS,
    )
    log_format: str = _option(
        "text",
        "text = one readable line per record; json = one JSON object per line (time, level, "
        "process, logger, message, request_id)",
        choices=LOG_FORMATS,
    )
    disable_log_requests: bool = _option(
        False,
        "no INFO line per finished request (the router's: id, tokens, TTFT, e2e, AL, finish "
        "reason, workers; a worker's: its part); a failed request is still logged, once, with its cause",
    )
    log_stats_interval_s: float = _option(
        10.0,
        "seconds between two stats lines (a worker's: running, waiting, KV usage per layer group, "
        "prompt and generation tok/s, AL; the router's: running, waiting, ready pairs, tok/s), "
        "printed only while requests run or wait or since the last line some ran; 0 = none",
        at_least(0),
    )
    shutdown_timeout_s: float = _option(
        30.0,
        "on SIGTERM: how long in-flight requests may take to finish (the router stops admitting "
        "at once; a worker deregisters first) before the rest are aborted with an error and the "
        "process exits",
        at_least(0),
    )


@dataclass(slots=True)
class ServingOptions:
    """What the router serves the model as (the workers take the name for their metrics)."""

    served_model_name: str = _option(
        "",
        "the model's name: in the router's API (/v1/models, the model field, ModelInfo) and "
        "in the model_name label of every process's metrics; default: the model folder's name",
    )
    chat_template: str = _option(
        "",
        "Jinja chat template file for /v1/chat/completions; default: the tokenizer's "
        "(chat_template.jinja or tokenizer_config.json's chat_template); without one, chat is refused",
    )
    prompt_special_tokens: str = _option(
        "text",
        "special-token text (e.g. <|im_start|>, </s>) in prompts and chat messages: text = encoded "
        "as the plain text it is, so no client forges a control token; parse = as the special "
        "token (transformers' default for trusted text)",
        choices=PROMPT_SPECIAL_TOKENS,
    )
    generation_config: str = _option(
        "auto",
        "sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty) for OpenAI requests "
        "that leave them unset: auto = the model folder's generation_config.json (vLLM's default), "
        "vllm = none (the API's neutral ones), else a folder holding a generation_config.json",
    )
    reasoning_parser: str = _option(
        "none",
        "split a chat answer's <think>...</think> into reasoning_content (streamed too): qwen3 = an "
        "answer opening with <think>; deepseek_r1 = the template opened it; none = the text as it comes",
        choices=REASONING_PARSERS,
    )
    tool_call_parser: str = _option(
        "none",
        "parse a chat answer's tool calls into tool_calls (streamed too) when a request sends tools "
        "with tool_choice auto: hermes (Qwen2.5/3, Hermes <tool_call>), llama3_json (Llama 3.x), "
        "mistral ([TOOL_CALLS]); none = tool_choice auto is refused",
        choices=TOOL_CALL_PARSERS,
    )


@dataclass(slots=True)
class TransferOptions:
    """A worker's deadlines for the pages of one request."""

    transfer_timeout_s: float = _option(30.0, "deadline of a page transfer and its acknowledgement", positive)
    lease_s: float = _option(
        60.0,
        "reserved pages are freed if their transfer and Decode have not come by then; also the cap on a "
        "Reserve's lease_ms",
        positive,
    )


_DEADLINES, _HTTP = Deadlines(), HttpLimits()


@dataclass(slots=True)
class RouterOptions:
    """What ``tandem router`` (and ``tandem up``, for its router) takes beyond the engine and
    serving options: what an unset max_tokens means, how workers are polled, the deadlines of
    the calls to workers, and what HTTP clients may hold."""

    default_max_tokens: int = _option(
        0,
        "what a request without max_tokens gets: 0 = the room its prompt leaves in the context "
        "(vLLM's default), else at most this many",
        at_least(0),
    )
    health_timeout_s: float = _option(2.0, "deadline of each Stats poll of a worker (every 0.5 s)", positive)
    health_misses: int = _option(
        2,
        "timed-out polls in a row after which a worker gets no traffic (a refused connection counts at once)",
        at_least(1),
    )
    worker_call_timeout_s: float = _option(
        _DEADLINES.call_s,
        "deadline of each Reserve and Release call to a decode worker (then: another pair)",
        positive,
    )
    prefill_timeout_s: float = _option(
        _DEADLINES.prefill_s,
        "deadline of each Prefill call: its queue, the prompt's run and the page transfer",
        positive,
    )
    prefill_timeout_per_1k_tokens_s: float = _option(
        _DEADLINES.prefill_per_1k_s,
        "added to --prefill-timeout-s per 1,000 prompt tokens: a long prompt's deadline grows with it",
        at_least(0),
    )
    stream_idle_timeout_s: float = _option(
        _DEADLINES.stream_idle_s,
        "longest wait between two messages of a Decode stream (then: UNAVAILABLE)",
        positive,
    )
    step_streams: bool = _option(
        True,
        "each Decode or Generate call carries its own tokens, one message per request per step (the "
        "served-speed benchmark's A/B baseline); by default one Steps stream per decode or aggregated "
        "worker carries every request's chunks of an engine step in one message",
        flags=("--no-step-streams",),
    )
    http_max_connections: int = _option(
        _HTTP.max_connections,
        "open HTTP connections at most (fewer if the open-file limit leaves fewer); a new one "
        "closes the longest-idle connection, else is answered 503 and closed",
        at_least(1),
    )
    http_max_connections_per_client: int = _option(
        _HTTP.max_per_client,
        "open HTTP connections of one client address at most (0 = no such limit); a new one "
        "closes that client's longest-idle connection, else is answered 503",
        at_least(0),
    )
    http_header_timeout_s: float = _option(
        _HTTP.timeouts.headers_s,
        "seconds after its request line for a request's headers (else 408)",
        positive,
    )
    http_body_timeout_s: float = _option(
        _HTTP.timeouts.body_s, "seconds after its headers for a request's whole body (else 408)", positive
    )


def process_settings(options: ProcessOptions) -> ProcessSettings:
    """What a serving process (router or worker) is told of its request and stats lines
    and its shutdown."""
    return ProcessSettings(
        log_requests=not options.disable_log_requests,
        stats_interval_s=options.log_stats_interval_s,
        shutdown_timeout_s=options.shutdown_timeout_s,
    )


def router_deadlines(options: RouterOptions) -> Deadlines:
    """The deadlines of the router's calls to workers."""
    o = options
    per_1k = o.prefill_timeout_per_1k_tokens_s
    return Deadlines(o.worker_call_timeout_s, o.prefill_timeout_s, o.stream_idle_timeout_s, per_1k)


def router_http_limits(options: RouterOptions) -> HttpLimits:
    """What the router's HTTP clients may hold."""
    o = options
    timeouts = ReadTimeouts(o.http_header_timeout_s, o.http_body_timeout_s)
    return HttpLimits(o.http_max_connections, timeouts, o.http_max_connections_per_client)


def add_engine_args(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """The flags of EngineOptions (or of the fields ``names``) on ``parser``."""
    add_args(parser, EngineOptions, names)


def served_model_name(model: str, name: str = "") -> str:
    """The model's name in the API and the metrics: ``name``, else the model folder's name."""
    return name or os.path.basename(os.path.normpath(model))
