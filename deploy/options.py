"""The engine and worker options every launcher takes, defined once.

Each option is a field of a dataclass below: its name is the Ray cluster.yaml key (under
``model:``, or a worker role for ``TransferOptions``), ``--`` plus the name in kebab case is
its ``tandem`` flag (``add_engine_args``), and the Helm values map onto the same flags.
``check`` refuses a bad value with a ValueError that starts with the option's name, without
loading torch; ``engine_config`` is the one place the options become an ``EngineConfig``.

Units: ``*_mb`` are MiB, ``*_s`` seconds. Paths are taken as given (launchers resolve them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.engine.config import EngineConfig

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the Tandem source tree
DEFAULT_MODEL = os.path.join(HERE, "models", "tiny-target")
DEFAULT_DRAFTER = os.path.join(HERE, "models", "tiny-drafter")
NO_DRAFTER = ("", "none")
LAYOUTS = ("auto", "unified", "separate")
DRAFT_QUANTIZATIONS = ("none", "fp8")
HOST_WRITE_POLICIES = ("evict", "through")  # kvcore.spec's (a module that loads torch)
# what the router takes of the engine options: its limits, its text, its page hashing
ROUTER_ENGINE_OPTIONS = ("model", "tokenizer", "num_spec_tokens", "tokens_per_page")

Rule = Callable[[Any], str]  # "" when the value is fine, else what is wrong with it


def at_least(low: int) -> Rule:
    return lambda value: "" if value >= low else f"must be >= {low}, got {value}"


def positive(value: float) -> str:
    return "" if value > 0 else f"must be > 0, got {value}"


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
    kv_cache_mb: int = _option(256, "KV memory per worker, MiB", at_least(1))
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


def add_engine_args(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """The flags of EngineOptions (or of the fields ``names``) on ``parser``."""
    add_args(parser, EngineOptions, names)


def add_args(parser: argparse.ArgumentParser, kind: type, names: Iterable[str] | None = None) -> None:
    """One flag per field of the options dataclass ``kind`` (or of the fields ``names``)."""
    chosen = set(names) if names is not None else None
    for f in dataclasses.fields(kind):
        if chosen is None or f.name in chosen:
            parser.add_argument(*_flags(f), dest=f.name, help=f.metadata["help"], **_parsing(f))


def from_args(kind: type, args: argparse.Namespace):
    """The ``kind`` options (a dataclass above) parsed into ``args``."""
    return kind(**{f.name: getattr(args, f.name) for f in dataclasses.fields(kind)})


def to_argv(options, names: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> list[str]:
    """The flags that give ``options`` (its fields ``names``, but not ``exclude``) again:
    only the values other than the defaults."""
    argv: list[str] = []
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if (names is not None and f.name not in names) or f.name in exclude or value == f.default:
            continue
        flag = _flags(f)[-1]
        argv += [flag] if isinstance(f.default, bool) else [flag, str(value)]
    return argv


def check(options) -> None:
    """Each option field's type and rule; for EngineOptions also the rules between fields.
    Raises ValueError starting with the field's name. Loads no torch. Fields that a
    launcher's subclass adds (without an option's metadata) are the launcher's to check."""
    for f in dataclasses.fields(options):
        if "help" not in f.metadata:
            continue
        value = getattr(options, f.name)
        problem = _type_problem(value, f.default) or _rule_problem(value, f.metadata)
        if problem:
            raise ValueError(f"{f.name}: {problem}")
    if isinstance(options, EngineOptions):
        _check_engine(options)


def engine_config(options: EngineOptions) -> EngineConfig:
    """The EngineConfig of ``options``; raises ValueError naming the option it refuses."""
    # services.engine.config loads torch, which only the processes that run an engine need
    from kvcore import KVLayout  # noqa: PLC0415 (torch: checking options loads none)
    from services.engine.config import EngineConfig  # noqa: PLC0415

    check(options)
    drafter = _drafter(options)
    return EngineConfig(
        model=options.model,
        drafter=drafter,
        tokenizer=options.tokenizer,
        num_spec_tokens=options.num_spec_tokens,
        device=options.device,
        dtype=options.dtype,
        tokens_per_page=options.tokens_per_page,
        kv_cache_bytes=options.kv_cache_mb << 20,
        host_kv_cache_bytes=options.host_kv_cache_mb << 20,
        host_kv_write_policy=options.host_kv_write_policy,
        host_kv_recall_min_pages=options.host_kv_recall_min_pages,
        max_num_seqs=options.max_num_seqs,
        layout=KVLayout("unified" if options.layout == "auto" else options.layout),
        enable_prefix_cache=options.prefix_cache,
        enforce_eager=not options.cuda_graphs,
        adaptive_k=options.adaptive_k,
        draft_quantization="" if options.draft_quantization == "none" else options.draft_quantization,
        tp_size=options.tp,
    )


def served_model_name(model: str, name: str = "") -> str:
    """The model's name in the API and the metrics: ``name``, else the model folder's name."""
    return name or os.path.basename(os.path.normpath(model))


def positive_float(text: str) -> float:
    """An argparse type: a float > 0."""
    return _parsed(float, positive)(text)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _parsed(int, at_least(1))(text)


# ---------------------------------------------------------------------- internals


def _drafter(options: EngineOptions) -> str | None:
    return None if options.drafter in NO_DRAFTER else options.drafter


def _check_engine(options: EngineOptions) -> None:
    speculative = _drafter(options) is not None and options.num_spec_tokens > 0
    if options.layout == "unified" and not speculative:
        raise ValueError(
            "layout: unified keeps the drafter's KV pages in the target's cache manager and "
            f"transfer, but no drafter runs here (drafter {options.drafter!r}, num_spec_tokens "
            f"{options.num_spec_tokens}); use layout separate or auto, or give a drafter and "
            "num_spec_tokens > 0"
        )
    if options.draft_quantization != "none" and not speculative:
        raise ValueError(
            f"draft_quantization: {options.draft_quantization} quantizes the drafter, and none "
            f"runs here (drafter {options.drafter!r}, num_spec_tokens {options.num_spec_tokens})"
        )
    if options.tp > 1 and options.host_kv_cache_mb:
        raise ValueError(
            "host_kv_cache_mb: the host KV tier's page copies are not mirrored to "
            f"tensor-parallel ranks; use it with tp 1, not {options.tp}"
        )


def _rule_problem(value: Any, metadata) -> str:
    choices = metadata["choices"]
    if choices and value not in choices:
        return f"must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}"
    return metadata["rule"](value) if metadata["rule"] else ""


def _flags(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata["flags"] or ("--" + f.name.replace("_", "-"),)


def _parsing(f: dataclasses.Field) -> dict:
    """add_argument's keywords for a field: a switch for a bool, else a checked type."""
    if isinstance(f.default, bool):
        return {"action": "store_false" if f.default else "store_true", "default": f.default}
    kind, rule, choices = type(f.default), f.metadata["rule"], f.metadata["choices"]
    return {"type": _parsed(kind, rule) if rule else kind, "default": f.default, "choices": choices or None}


def _parsed(kind: type, rule: Rule) -> Callable[[str], Any]:
    def parse(text: str):
        value = kind(text)
        problem = rule(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def _type_problem(value: Any, default: Any) -> str:
    """What is wrong with ``value``'s type for a field defaulting to ``default`` ("" if nothing);
    an int may stand for a float, a bool never for a number."""
    want = type(default)
    ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
    if want is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return "" if ok else f"must be {names[want]}, got {value!r}"
