"""Engine configuration: models, device, cache geometry and batching limits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore import KVLayout
from kvcore.spec import dtype_from_name

DEFAULT_DTYPES = {"cpu": "float32", "cuda": "bfloat16"}
# How a step's decode rows and prefill chunks share the target: "mixed" runs them in one
# forward (the decode rows ride on the prefill's weight reads); "decode-first" and
# "prefill-first" run two forwards in that order. The default is ``default_policy``'s.
SCHEDULING_POLICIES = ("mixed", "decode-first", "prefill-first")
# What a RequestOutput carries: "cumulative", the output so far (token ids, text, logprobs);
# "delta", only what this step added (token ids and logprobs, no text: a served worker's,
# whose router detokenizes; as vLLM's RequestOutputKind.DELTA). Cumulative outputs copy the
# whole output every step: 0.8 ms a step for 64 requests of 2,048 tokens on one core.
OUTPUT_KINDS = ("cumulative", "delta")


def default_policy(device_type: str, speculative: bool, cuda_graphs: bool) -> str:
    """The scheduling policy when none is given: "decode-first" on the CPU, and with a
    drafter whose steps replay CUDA graphs; else "mixed".

    - A mixed step is one eager forward: it saves the decode rows' weight read (the 8B-shaped
      target alone on an H100: +24% output tok/s at C=64 on the engine alone).
    - With a drafter it also gives up the graphed drafting step (the catch-up, the draft chain
      and the verify in one replay) for the eager ones, which cost more than the read saved:
      decode-first +35% for the 8B-shaped pair, +27-74% served for the tiny pair
      (docs/performance.md, "The scheduling policy by model"). Without graphs
      (``enforce_eager``, tensor parallelism) both run eagerly, and mixed saves the read.
    - The CPU reference attention pads every query block to the longest, so mixing costs it.
    """
    if device_type != "cuda" or (speculative and cuda_graphs):
        return "decode-first"
    return "mixed"


@dataclass(slots=True)
class EngineConfig:
    """``num_spec_tokens`` is K, the drafts per verify step; 0 (or no ``drafter``) runs
    the target alone. KV memory is ``num_pages`` pages per layer group (the target's groups,
    then the draft's) when given, else a byte budget split by kvcore's capacity rule:
    ``kv_cache_bytes``, or, when ``gpu_memory_utilization`` > 0 (CUDA only), what that
    fraction of the device's memory leaves after the weights, a profile forward's
    activations and the CUDA graphs (services/engine/memory_profile.py). Token counts are
    per step: decode takes K + 1 per request, prefill chunks take the rest of
    ``max_num_batched_tokens``, at most ``max_prefill_chunk`` per request; 0 = derived
    from the target and the device (``step_budget.py``), and a chunk of 0 = the step's budget.
    ``max_model_len`` > 0 must fit the KV cache (one request of that many tokens, every
    layer group) or the engine refuses to start; 0 takes the model's
    ``max_position_embeddings`` unchecked (requests are still checked)."""

    model: str
    drafter: str | None = None
    tokenizer: str = ""  # a folder or tokenizer.json; "" = the model folder's own
    num_spec_tokens: int = 4
    device: str = "cpu"
    dtype: str = ""  # "" = float32 on CPU, bfloat16 on CUDA
    tokens_per_page: int = 16
    num_pages: tuple[int, ...] = ()
    kv_cache_bytes: int = 256 << 20
    gpu_memory_utilization: float = 0.0  # > 0: the KV cache from this fraction of the GPU instead
    max_num_seqs: int = 64
    stream_interval: int = 1  # tokens a running request's output gathers first (step_outputs.py)
    max_num_batched_tokens: int = 1024
    max_prefill_chunk: int = 512
    scheduling_policy: str = ""  # SCHEDULING_POLICIES; "" = default_policy's
    max_model_len: int = 0  # 0 = the target's max_position_embeddings
    layout: KVLayout = KVLayout.UNIFIED
    enable_prefix_cache: bool = True
    host_kv_cache_bytes: int = 0  # host tier under the prefix cache; 0 = none
    host_kv_write_policy: str = "evict"  # kvcore.spec.HOST_WRITE_POLICIES
    host_kv_recall_min_pages: int = 1  # shorter host hits are recomputed, not recalled
    enforce_eager: bool = False  # True: no CUDA graphs for the decode step
    device_draft_chain: bool = True  # batches without penalties or pending min_tokens: one host read a step
    adaptive_k: bool = True  # with CUDA graphs: a step drafts only when it pays (adaptive_k.py)
    quantization: str = ""  # "fp8": the target's linears quantized at load (models/fp8.py); "" = as loaded
    draft_quantization: str = ""  # "fp8": the drafter's own weights in e4m3 (models/fp8.py); "" = as loaded
    seed: int = 0
    output_kind: str = "cumulative"  # OUTPUT_KINDS: what each RequestOutput carries (request.py)
    # graphed decode steps, target-only or drafting: launch step n + 1 before reading step n
    # (overlapped_steps.py); on a CPU the same static-buffer path runs uncaptured
    overlap: bool = False
    tp_size: int = 1  # tensor-parallel ranks (processes) running the models; see parallel.py
    # Benchmarks only, NOT lossless: the verifier keeps exactly this many drafts per step
    # (at most a request's K), whatever the models say; -1 = off. Refused unless
    # ``unsafe_forced_acceptance`` is True too; serving (deploy/options.py) sets neither.
    forced_acceptance: int = -1
    unsafe_forced_acceptance: bool = False

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: a target model folder is required")
        if self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens: must be >= 0, got {self.num_spec_tokens}")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device: {e}") from None
        if self.overlap and (self.enforce_eager or self.tp_size > 1):
            why = "enforce_eager runs the step eagerly" if self.enforce_eager else f"tp_size {self.tp_size}"
            raise ValueError(f"overlap: overlapped steps run the graphs' static-buffer path, and {why}")
        if not self.dtype:
            self.dtype = DEFAULT_DTYPES.get(torch.device(self.device).type, "float32")
        dtype_from_name(self.dtype)
        if not self.scheduling_policy:
            device_type = torch.device(self.device).type
            self.scheduling_policy = default_policy(device_type, self.speculative, self.cuda_graphs)
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind: must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy: must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        for name in (
            "tokens_per_page",
            "kv_cache_bytes",
            "max_num_seqs",
            "stream_interval",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("max_num_batched_tokens", "max_prefill_chunk"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be > 0, or 0 for derived, got {getattr(self, name)}")
        if self.host_kv_cache_bytes < 0:
            raise ValueError(f"host_kv_cache_bytes: must be >= 0, got {self.host_kv_cache_bytes}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len: must be >= 0, got {self.max_model_len}")
        check_gpu_memory_utilization(self.gpu_memory_utilization, torch.device(self.device).type)
        if not isinstance(self.layout, KVLayout):
            raise ValueError(f"layout: must be a KVLayout, got {self.layout!r}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size: must be >= 1, got {self.tp_size}")
        check_forced_acceptance(self.forced_acceptance, self.unsafe_forced_acceptance)
        check_draft_quantization(self.draft_quantization, self.speculative)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.tp_size > 1 and self.host_kv_cache_bytes:
            raise ValueError(
                "host_kv_cache_bytes: the host KV tier's page copies are not "
                f"mirrored to tensor-parallel ranks; use it with tp_size 1, not "
                f"{self.tp_size}"
            )

    @property
    def speculative(self) -> bool:
        return self.drafter is not None and self.num_spec_tokens > 0

    @property
    def cuda_graphs(self) -> bool:
        """Decode-step forwards replay CUDA graphs: on CUDA, unless ``enforce_eager``
        (or tensor parallelism: every forward must be published to the other ranks)."""
        return not self.enforce_eager and torch.device(self.device).type == "cuda" and self.tp_size == 1

    @property
    def static_decode(self) -> bool:
        """Decode steps run the graphs' static-buffer path: captured (``cuda_graphs``), or
        uncaptured on a CPU for ``overlap``, where nothing runs beside the host (the
        overlapped path itself, at no speed-up: a way to run it without a GPU)."""
        return self.cuda_graphs or (self.overlap and torch.device(self.device).type == "cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


def check_gpu_memory_utilization(fraction: float, device_type: str) -> None:
    """A fraction in (0, 1] of a CUDA device's memory, or 0 for none (size by bytes)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], or 0 for none, got {fraction}")
    if fraction and device_type != "cuda":
        raise ValueError(
            f"gpu_memory_utilization: sizes the KV cache from a CUDA device's memory, not {device_type}'s"
        )


def forced_acceptance_banner(accept: int) -> str:
    """What a process running with forced acceptance ``accept`` (>= 0) says at start."""
    return (
        f"UNSAFE FORCED ACCEPTANCE (--unsafe-forced-acceptance {accept}), BENCHMARKS ONLY: every "
        f"step keeps exactly {accept} drafts whatever the target says, so the acceptance length is "
        f"forced to {accept + 1} and the outputs are NOT the target model's"
    )


def check_forced_acceptance(accept: int, unsafe: bool) -> None:
    """Forced acceptance (``accept`` >= 0) is a benchmark switch whose outputs are not
    lossless: ValueError unless ``unsafe`` says the caller asked for exactly that."""
    if accept < -1:
        raise ValueError(f"forced_acceptance: must be >= 0, or -1 for off, got {accept}")
    if accept >= 0 and not unsafe:
        raise ValueError(
            f"forced_acceptance: {accept} keeps drafts whatever the target says, so outputs are "
            "not lossless; benchmarks only, refused unless unsafe_forced_acceptance is set "
            "(--unsafe-forced-acceptance N)"
        )


DRAFT_QUANTIZATIONS = ("", "fp8")
QUANTIZATIONS = ("", "fp8")  # the target's (models/loader.py)


def check_draft_quantization(kind: str, speculative: bool) -> None:
    """ValueError naming ``draft_quantization`` unless ``kind`` is one this engine runs."""
    if kind not in DRAFT_QUANTIZATIONS:
        raise ValueError(f"draft_quantization: must be one of {DRAFT_QUANTIZATIONS}, got {kind!r}")
    if kind and not speculative:
        raise ValueError(
            f"draft_quantization: {kind} quantizes the drafter, and none runs (no drafter or K = 0)"
        )
