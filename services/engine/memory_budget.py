"""How much device memory a worker's KV cache gets under ``--gpu-memory-utilization``, as
vLLM sizes it: pure arithmetic over stated readings (no torch), so it is tested on the CPU.

    kv = total * utilization - weights - activations - graphs - other

Every size is in bytes. What each reading is, and where services/engine/memory_profile.py
takes it on a CUDA device:

- ``total``: the device's memory (``torch.cuda.mem_get_info()[1]``);
- ``weights``: what the loaded models hold (``torch.cuda.memory_allocated()`` after loading);
- ``activations``: the peak a profile forward at the step's widest token count added
  (``torch.cuda.max_memory_allocated()`` during it, less what was allocated before it);
- ``graphs``: what the decode step's CUDA graphs will hold. They are captured after the KV
  cache exists, so this is an estimate: the profile's activation peak (their forwards run
  at most as many tokens), 0 without graphs; the engine logs what they took;
- ``other``: memory outside torch's allocator (the CUDA context, library workspaces, NCCL),
  a stated estimate (NON_TORCH_BYTES): on a GPU several workers share, a reading of the
  device's used memory would count the others' too.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
NON_TORCH_BYTES = 1 << 30  # the estimate of ``other``: CUDA context, cuBLAS/NCCL workspaces


@dataclass(frozen=True, slots=True)
class MemoryReadings:
    """One device's readings at start, in bytes (the module docstring says what each is)."""

    total: int
    weights: int
    activations: int
    graphs: int
    other: int = NON_TORCH_BYTES


def kv_budget_bytes(readings: MemoryReadings, utilization: float) -> int:
    """Bytes left for the KV cache in ``utilization`` (0 < u <= 1) of the device; ValueError
    naming gpu_memory_utilization, with every reading, when nothing is left."""
    r = readings
    kv = int(r.total * utilization) - r.weights - r.activations - r.graphs - r.other
    if kv <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {utilization} leaves no memory for the KV cache: "
            f"{describe_budget(r, utilization, kv)}; raise it, or lower --max-num-batched-tokens"
        )
    return kv


def check_free(kv_bytes: int, readings: MemoryReadings, free: int, utilization: float) -> None:
    """What the worker still allocates (the KV cache, its activations and graphs) must fit
    the device's ``free`` bytes now; else another process holds memory this fraction assumed
    (ValueError naming gpu_memory_utilization)."""
    need = kv_bytes + readings.activations + readings.graphs
    if need > free:
        raise ValueError(
            f"gpu_memory_utilization: {utilization} of the device gives the KV cache "
            f"{kv_bytes // MIB} MiB, and this worker needs {need // MIB} MiB more in all, but only "
            f"{free // MIB} MiB of the device's {readings.total // MIB} MiB are free (other "
            "processes hold the rest); lower it, or give --kv-cache-mb"
        )


def describe_budget(readings: MemoryReadings, utilization: float, kv_bytes: int) -> str:
    """The arithmetic of :func:`kv_budget_bytes` in MiB, for the log."""
    r = readings
    return (
        f"{utilization} x {r.total // MIB} MiB = {int(r.total * utilization) // MIB} MiB, less weights "
        f"{r.weights // MIB}, activations {r.activations // MIB}, CUDA graphs {r.graphs // MIB} "
        f"(estimate), other {r.other // MIB} (estimate: CUDA context, workspaces) = "
        f"{kv_bytes // MIB} MiB for the KV cache"
    )


def profile_tokens(max_num_batched_tokens: int, max_num_seqs: int, num_spec_tokens: int) -> int:
    """Tokens of the profile forward: the widest target forward a step runs, a prefill
    step's whole budget or a decode step's K + 1 tokens per request."""
    return max(max_num_batched_tokens, max_num_seqs * (num_spec_tokens + 1))


def profile_lengths(tokens: int, max_model_len: int) -> list[int]:
    """``tokens`` split into sequences of at most ``max_model_len - 1`` tokens (each leaves
    room for one more), longest first."""
    longest = max(1, max_model_len - 1)
    full, rest = divmod(tokens, longest)
    return [longest] * full + ([rest] if rest else [])


def group_line(name: str, pages: int, tokens_per_page: int, page_bytes: int) -> str:
    """One layer group's share of the KV cache, as logged at start."""
    return (
        f"KV cache group {name}: {pages} pages, {pages * tokens_per_page} tokens, "
        f"{pages * page_bytes / MIB:.1f} MiB"
    )
