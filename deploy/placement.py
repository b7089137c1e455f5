"""Which GPUs each worker of a local cluster takes (``tandem up --device cuda``).

Workers are placed in the order they start (prefill workers, then decode workers, or the
aggregated ones): each takes its TP size of consecutive GPUs from a cursor that starts at
GPU 0, so a 1 + 1 cluster on two GPUs runs prefill on GPU 0 and decode on GPU 1, and a
prefill TP 2 -> decode TP 1 cluster on three runs prefill on GPUs 0-1 and decode on GPU 2.
Past the last GPU the cursor wraps, and workers share GPUs. ``--device cuda:i`` places
every worker at GPU i instead (a TP group's rank r at GPU i + r); ``--gpus N`` says how many
GPUs there are (default: what ``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi -L`` lists).

Workers that share a GPU each size their KV cache from a fraction of its memory: unless
``--gpu-memory-utilization`` or ``--kv-cache-mb`` is given, the default fraction (0.9) is
split evenly among the ranks on the GPU (:func:`memory_shares`), as ``tandem up`` prints;
a given fraction is each worker's own, as in vLLM. Loads no torch.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections import Counter

from deploy.option_rules import is_cuda
from deploy.options import DEFAULT_GPU_MEMORY_UTILIZATION, EngineOptions


def visible_gpus() -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES's entries, else nvidia-smi's; 0 = none found."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return len([d for d in listed.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def gpu_bases(tp_sizes: list[int], gpus: int) -> list[int]:
    """The first GPU of each worker (TP sizes in start order) on ``gpus`` GPUs (at least 1)."""
    gpus, cursor, bases = max(gpus, 1), 0, []
    for tp in tp_sizes:
        if cursor + tp > gpus:
            cursor = 0
        bases.append(cursor)
        cursor += tp
    return bases


def shares_gpus(tp_sizes: list[int], gpus: int) -> bool:
    """Whether some GPU holds more than one worker's ranks."""
    return sum(tp_sizes) > max(gpus, 1)


def on_gpus(
    roles: list[tuple[str, list[str]]], tp_sizes: list[int], gpus: int
) -> list[tuple[str, list[str]]]:
    """``roles`` (role, extra worker flags) with each worker's ``--device cuda:<first GPU>``
    added; says on stderr when workers must share GPUs."""
    if shares_gpus(tp_sizes, gpus):
        print(f"tandem up: {sum(tp_sizes)} worker ranks share {max(gpus, 1)} GPU(s)", file=sys.stderr)
    bases = gpu_bases(tp_sizes, gpus)
    return [
        (role, [*extra, "--device", f"cuda:{base}"]) for (role, extra), base in zip(roles, bases, strict=True)
    ]


def memory_shares(bases: list[int], tp_sizes: list[int], fraction: float) -> list[float]:
    """Each worker's fraction of its GPUs' memory when ``fraction`` is split evenly among
    the ranks on a GPU: ``fraction`` over the most ranks any of the worker's GPUs holds
    (a worker's ranks take GPUs base .. base + tp - 1), rounded down to 4 decimals."""
    load = Counter(g for base, tp in zip(bases, tp_sizes, strict=True) for g in range(base, base + tp))
    most = [max(load[g] for g in range(base, base + tp)) for base, tp in zip(bases, tp_sizes, strict=True)]
    return [math.floor(fraction / n * 10_000) / 10_000 for n in most]


def share_memory(
    roles: list[tuple[str, list[str]]], bases: list[int], tp_sizes: list[int], fraction: float
) -> list[tuple[str, list[str]]]:
    """``roles`` with ``--gpu-memory-utilization <share>`` added to each worker that shares
    a GPU (see :func:`memory_shares`); says on stderr which share each shared GPU gives."""
    shares = memory_shares(bases, tp_sizes, fraction)
    out = []
    for (role, extra), base, tp, share in zip(roles, bases, tp_sizes, shares, strict=True):
        if share < fraction:
            gpus = f"GPU {base}" if tp == 1 else f"GPUs {base}-{base + tp - 1}"
            print(
                f"tandem up: a {role} worker shares {gpus}: --gpu-memory-utilization {share} "
                f"(the default {fraction}, split evenly among the ranks on a GPU)",
                file=sys.stderr,
            )
            extra = [*extra, "--gpu-memory-utilization", str(share)]
        out.append((role, extra))
    return out


def place_workers(
    engine: EngineOptions, roles: list[tuple[str, list[str]]], gpus: int
) -> list[tuple[str, list[str]]]:
    """``roles`` (role, ["--tp", n]) with their GPUs on CUDA, and each
    worker on a shared GPU its share of the default memory fraction unless the KV cache is
    sized by a flag; unchanged elsewhere."""
    if gpus and engine.device != "cuda":
        raise SystemExit(f"tandem up: gpus: places workers with --device cuda, not {engine.device!r}")
    if not is_cuda(engine.device):
        return roles
    tps = [int(extra[1]) for _, extra in roles]
    if engine.device == "cuda":  # one GPU (or TP group) per worker, while there are enough
        gpus = gpus or visible_gpus()
        roles, bases = on_gpus(roles, tps, gpus), gpu_bases(tps, gpus)
    else:  # cuda:i: every worker from GPU i
        bases = [int(engine.device.partition(":")[2])] * len(roles)
    if engine.kv_cache_mb or engine.gpu_memory_utilization:
        return roles
    return share_memory(roles, bases, tps, DEFAULT_GPU_MEMORY_UTILIZATION)
