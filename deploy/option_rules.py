"""The value rules of deploy/options.py: one field's (``Rule``s, types, choices) and the
engine options' rules between fields. Every refusal names the option first; no torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deploy.options import EngineOptions

Rule = Callable[[Any], str]  # "" when the value is fine, else what is wrong with it
NO_DRAFTER = ("", "none")


def at_least(low: int) -> Rule:
    return lambda value: "" if value >= low else f"must be >= {low}, got {value}"


def positive(value: float) -> str:
    return "" if value > 0 else f"must be > 0, got {value}"


def fraction_or_zero(value: float) -> str:
    """A fraction in (0, 1], or 0 for "the default"."""
    return "" if 0 <= value <= 1 else f"must be in (0, 1], or 0 for the default, got {value}"


def rule_problem(value: Any, metadata) -> str:
    choices = metadata["choices"]
    if choices and value not in choices:
        return f"must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}"
    return metadata["rule"](value) if metadata["rule"] else ""


def type_problem(value: Any, default: Any) -> str:
    """What is wrong with ``value``'s type for a field defaulting to ``default`` ("" if nothing);
    an int may stand for a float, a bool never for a number."""
    want = type(default)
    ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
    if want is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return "" if ok else f"must be {names[want]}, got {value!r}"


def drafter_of(options: EngineOptions) -> str | None:
    """The drafter folder, or None for no drafter."""
    return None if options.drafter in NO_DRAFTER else options.drafter


def is_cuda(device: str) -> bool:
    """Whether a torch device string names a CUDA device (``cuda``, ``cuda:1``)."""
    return device == "cuda" or device.startswith("cuda:")


def check_engine(options: EngineOptions) -> None:
    """The rules between engine options; ValueError starting with the option refused."""
    _check_speculation(options)
    _check_memory(options)
    _check_overlap(options)
    if options.tp > 1 and options.host_kv_cache_mb:
        raise ValueError(
            "host_kv_cache_mb: the host KV tier's page copies are not mirrored to "
            f"tensor-parallel ranks; use it with tp 1, not {options.tp}"
        )


def _check_speculation(options: EngineOptions) -> None:
    speculative = drafter_of(options) is not None and options.num_spec_tokens > 0
    runs = f"drafter {options.drafter!r}, num_spec_tokens {options.num_spec_tokens}"
    if options.layout == "unified" and not speculative:
        raise ValueError(
            "layout: unified keeps the drafter's KV pages in the target's cache manager and "
            f"transfer, but no drafter runs here ({runs}); use layout separate or auto, or give "
            "a drafter and num_spec_tokens > 0"
        )
    if options.draft_quantization != "none" and not speculative:
        raise ValueError(
            f"draft_quantization: {options.draft_quantization} quantizes the drafter, and none "
            f"runs here ({runs})"
        )
    forced = options.unsafe_forced_acceptance
    if forced >= 0 and not speculative:
        raise ValueError(
            f"unsafe_forced_acceptance: {forced} forces the acceptance of drafts, and no drafter "
            f"drafts here ({runs}): nothing to force"
        )
    if forced > options.num_spec_tokens:
        raise ValueError(
            f"unsafe_forced_acceptance: {forced} drafts kept per step, but only "
            f"num_spec_tokens {options.num_spec_tokens} are drafted"
        )


def _check_overlap(options: EngineOptions) -> None:
    """--overlap-decode acts on decode steps replayed from CUDA graphs: refused where no
    step of this engine could overlap."""
    if not options.overlap_decode:
        return
    if not is_cuda(options.device):
        why = f"device {options.device} runs eagerly"
    elif not options.cuda_graphs:
        why = "--enforce-eager turns the graphs off"
    elif options.tp > 1:
        why = f"tp {options.tp} runs eagerly"
    else:
        return
    raise ValueError(f"overlap_decode: overlapped steps are CUDA-graph replays, and {why}")


def _check_memory(options: EngineOptions) -> None:
    """--gpu-memory-utilization sizes the KV cache on CUDA; --kv-cache-mb sizes it anywhere:
    one of the two at most, and the first on CUDA only."""
    fraction = options.gpu_memory_utilization
    if not fraction:
        return
    if options.kv_cache_mb:
        raise ValueError(
            f"gpu_memory_utilization: {fraction} sizes the KV cache from the GPU's memory, and "
            f"kv_cache_mb {options.kv_cache_mb} sizes it already; give one of them"
        )
    if not is_cuda(options.device):
        raise ValueError(
            f"gpu_memory_utilization: {fraction} sizes the KV cache from a CUDA device's memory; "
            f"device is {options.device!r}: give kv_cache_mb there (default 256 MiB)"
        )
