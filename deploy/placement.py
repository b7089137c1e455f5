"""Which GPUs each worker of a local cluster takes (``tandem up --device cuda``).

Workers are placed in the order they start (prefill workers, then decode workers, or the
aggregated ones): each takes its TP size of consecutive GPUs from a cursor that starts at
GPU 0, so a 1 + 1 cluster on two GPUs runs prefill on GPU 0 and decode on GPU 1, and a
prefill TP 2 -> decode TP 1 cluster on three runs prefill on GPUs 0-1 and decode on GPU 2.
Past the last GPU the cursor wraps, and workers share GPUs (each then holds its own KV pool
on them: size ``--kv-cache-mb`` to fit). ``--device cuda:i`` places every worker at GPU i
instead, as before; ``--gpus N`` says how many GPUs there are (default: what
``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi -L`` lists). Loads no torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


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
