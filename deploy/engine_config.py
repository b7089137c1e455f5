"""The one place the engine options become an ``EngineConfig`` (loading torch's side of the
tree only when called), and the sizes derived from the options and the model folder."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from deploy.option_check import check, drafter_of
from deploy.option_rules import is_cuda
from deploy.options import CPU_KV_CACHE_MB, DEFAULT_GPU_MEMORY_UTILIZATION, EngineOptions

if TYPE_CHECKING:
    from services.engine.config import EngineConfig


def engine_config(options: EngineOptions) -> EngineConfig:
    """The EngineConfig of ``options``; raises ValueError naming the option it refuses."""
    # services.engine.config loads torch, which only the processes that run an engine need
    from kvcore import KVLayout  # noqa: PLC0415 (torch: checking options loads none)
    from services.engine.config import EngineConfig  # noqa: PLC0415

    check(options)
    forced = options.unsafe_forced_acceptance
    return EngineConfig(
        model=options.model,
        drafter=drafter_of(options),
        tokenizer=options.tokenizer,
        num_spec_tokens=options.num_spec_tokens,
        device=options.device,
        dtype=options.dtype,
        tokens_per_page=options.tokens_per_page,
        kv_cache_bytes=(options.kv_cache_mb or CPU_KV_CACHE_MB) << 20,
        gpu_memory_utilization=gpu_memory_fraction(options),
        max_model_len=options.max_model_len or model_max_len(options.model),
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_prefill_chunk=options.max_num_batched_tokens,  # one prompt may take the whole step
        scheduling_policy="" if options.scheduling_policy == "auto" else options.scheduling_policy,
        host_kv_cache_bytes=options.host_kv_cache_mb << 20,
        host_kv_write_policy=options.host_kv_write_policy,
        host_kv_recall_min_pages=options.host_kv_recall_min_pages,
        max_num_seqs=options.max_num_seqs,
        stream_interval=options.stream_interval,
        layout=KVLayout("unified" if options.layout == "auto" else options.layout),
        enable_prefix_cache=options.prefix_cache,
        enforce_eager=not options.cuda_graphs,
        adaptive_k=options.adaptive_k,
        overlap=options.overlap_decode,
        quantization="" if options.quantization == "none" else options.quantization,
        draft_quantization="" if options.draft_quantization == "none" else options.draft_quantization,
        tp_size=options.tp,
        forced_acceptance=forced,
        unsafe_forced_acceptance=forced >= 0,
    )


def check_device_present(device: str) -> None:
    """Raises ValueError naming ``--device`` when it asks for a CUDA device torch does not
    see (a CPU-only torch, no visible GPU, ``cuda:i`` past the last GPU), before a worker
    is placed or an engine loads. Loads torch: for the processes that run or place engines."""
    if not is_cuda(device):
        return
    import torch  # noqa: PLC0415 (checking options loads none)

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found == 0:
        raise ValueError(f"device: --device {device}, but torch sees no CUDA device; use --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= found:
        raise ValueError(f"device: --device {device}, but torch sees {found} CUDA device(s)")


def gpu_memory_fraction(options: EngineOptions) -> float:
    """The fraction of its GPU a worker sizes its KV cache from: the option, else the default
    on CUDA; 0 (size it by kv_cache_mb) when kv_cache_mb is given or the device is not CUDA."""
    if options.kv_cache_mb or not is_cuda(options.device):
        return 0.0
    return options.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION


def model_max_len(model: str) -> int:
    """The model folder's ``max_position_embeddings`` (config.json); ValueError naming
    ``model`` when it cannot be read."""
    path = os.path.join(model, "config.json")
    try:
        with open(path) as f:
            return int(json.load(f)["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model: cannot read max_position_embeddings from {path}: {e}") from None
