"""Checking options: each field's type and rule, and for EngineOptions the rules between
its fields (a drafter's options without a drafter, the KV size given twice, overlap where
no step could overlap). Loads no torch: launchers check before placing anything."""

from __future__ import annotations

import dataclasses

from deploy.option_rules import NO_DRAFTER, is_cuda, rule_problem, type_problem
from deploy.options import EngineOptions


def check(options) -> None:
    """Each option field's type and rule; for EngineOptions also the rules between fields.
    Raises ValueError starting with the field's name. Loads no torch. Fields that a
    launcher's subclass adds (without an option's metadata) are the launcher's to check."""
    for f in dataclasses.fields(options):
        if "help" not in f.metadata:
            continue
        value = getattr(options, f.name)
        problem = type_problem(value, f.default) or rule_problem(value, f.metadata)
        if problem:
            raise ValueError(f"{f.name}: {problem}")
    if isinstance(options, EngineOptions):
        check_engine(options)


def drafter_of(options: EngineOptions) -> str | None:
    """The drafter folder, or None for no drafter."""
    return None if options.drafter in NO_DRAFTER else options.drafter


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
    """--overlap-decode acts on decode steps through the graphs' static-buffer path: refused
    where this engine runs its steps eagerly. (On a CPU that path runs uncaptured: the
    overlapped steps run, with nothing beside the host to overlap, for testing the path.)"""
    if not options.overlap_decode:
        return
    if not options.cuda_graphs:
        why = "--enforce-eager runs every step eagerly"
    elif options.tp > 1:
        why = f"tp {options.tp} runs eagerly"
    else:
        return
    raise ValueError(f"overlap_decode: overlapped steps run the CUDA graphs' path, and {why}")


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
