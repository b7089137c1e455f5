"""The engine: one process serving many requests with speculative decoding.

    engine = Engine(EngineConfig(model="models/tiny-target", drafter="models/tiny-drafter"))
    outputs = engine.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))

Streaming use: ``add_request`` then call ``step`` while ``has_unfinished``; each step
returns the news of every request it touched. For disaggregated serving, a prefill worker
adds requests with ``prefill_only=True`` (they finish with reason "prefilled", an
``AuxState`` and their pages kept until ``release``); a decode worker reserves pages for
them (``reserve``; ``release_reservation`` gives them back) and continues them with
``add_prefilled`` once their pages have landed.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from kvcore import AuxState, CacheStats, KVLayout, Reservation
from services.engine.batch import Span, StepResult, TargetRun
from services.engine.checks import (
    RequestExists,
    check_context_fits,
    check_fits,
    check_prompt_ids,
    check_prompt_len,
    check_sampling,
    check_spec_tokens,
    encode_prompt,
    eos_ids,
)
from services.engine.config import EngineConfig
from services.engine.device.adaptive_k import AdaptiveK, greedy_only
from services.engine.device.cuda_graphs import capture_decode_graphs
from services.engine.device.device_step import device_step, device_step_fits
from services.engine.grammar import GrammarCompiler
from services.engine.lockstep import attach_lockstep
from services.engine.memory_budget import MemoryReadings
from services.engine.memory_profile import derive_kv_bytes, graphs_taken
from services.engine.models import load_drafter, load_target
from services.engine.overlapped_steps import OverlappedSteps
from services.engine.parallel import rank_device, tensor_parallel
from services.engine.progress import RequestProgress
from services.engine.request import PrefillSpan, Request, RequestOutput, Status
from services.engine.runner import ModelRunner
from services.engine.sampling.noise import SEED_BITS, request_seed
from services.engine.sampling.params import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.setup import build_cache, cache_config, log_groups, log_scheduling
from services.engine.speculation.speculative import draft, draft_prefill, verify_spans
from services.engine.speculation.verify import sample_first, verify
from services.engine.step_budget import with_step_budget
from services.engine.step_outputs import StepOutputs
from services.engine.warm_up import warm_up
from services.tokenization.tokenizer import load_tokenizer


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tp = tensor_parallel(config.tp_size)
        self.device = rank_device(config.device, self.tp)
        self.target = load_target(config.model, self.device, config.torch_dtype, self.tp, config.quantization)
        derived = config.max_num_batched_tokens == 0
        config = self.config = with_step_budget(config, self.target.config, self.device.type)
        self.drafter = None
        if config.speculative:
            self.drafter = load_drafter(config.drafter, self.device, config.torch_dtype, self.tp)
            self.drafter.config = self.drafter.config.check_target(self.target.config)
            if config.draft_quantization == "fp8":
                self.drafter.quantize_fp8()
        self.k = config.num_spec_tokens if self.drafter is not None else 0
        self.max_model_len = config.max_model_len or self.target.config.max_position_embeddings
        cache = cache_config(config, self.target, self.drafter, self.k)
        self.memory: MemoryReadings | None = None  # the readings behind gpu_memory_utilization
        if config.gpu_memory_utilization:  # the KV cache gets what the GPU's fraction leaves
            kv_bytes, self.memory = derive_kv_bytes(self, cache)
            cache = replace(cache, memory_bytes=kv_bytes)
        self.manager, self.kv_pools = build_cache(cache, self.target, self.drafter, self.device, self.tp)
        log_groups(self.manager)
        log_scheduling(config.scheduling_policy, config.max_num_batched_tokens, config.max_num_seqs, derived)
        if config.max_model_len:  # asked for: one request of it must fit, every group
            check_context_fits(config.max_model_len, self.manager)
        self.runner = ModelRunner(self.target, self.drafter, self.manager, self.kv_pools, self.device)
        attach_lockstep(self.runner, self.tp)
        self.adaptive: AdaptiveK | None = None  # the per-step K rule, with graphs and K > 0
        if config.cuda_graphs:
            self._capture_graphs()
        elif config.static_decode:  # overlap on a CPU: the graphs' path, uncaptured
            self.runner.graphs = capture_decode_graphs(
                self.runner, self.k + 1, config.max_num_seqs, self.max_model_len, capture=False
            )
        self.scheduler = Scheduler(
            self.manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_prefill_chunk,
            self.k,
            self.drafter is not None,
        )
        self.tokenizer = load_tokenizer(config.model, config.tokenizer)
        self.out = StepOutputs(
            self.tokenizer,
            eos_ids(config.model, self.target.config, self.tokenizer),
            self.k > 0,
            delta=config.output_kind == "delta",
            interval=config.stream_interval,
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.target.config.vocab_size, self.out.eos_ids)
        self.requests: dict[str, Request] = {}
        self.progress = RequestProgress(
            self.manager, self.scheduler, self.out, self.requests, self.drafter is not None
        )
        self.stats = self.progress.stats  # speculative counters per origin
        self.last_step = ""  # the last step's forwards: decode, prefill, mixed, decode+prefill or overlapped
        self.overlapped = OverlappedSteps(
            config, self.runner, self.scheduler, self.progress, lambda: self.adaptive
        )
        self._seeds = random.Random(config.seed)
        self._ids = itertools.count()
        if self.device.type == "cuda" and self.tp.size == 1:  # TP ranks step in lockstep only once served
            warm_up(self)

    # ------------------------------------------------------------ public API

    def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        prefill_only: bool = False,
        num_spec_tokens: int | None = None,
        first_token_id: int | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError naming the bad field.
        ``num_spec_tokens``: drafts verified per step for this request, 0..K (None = K).
        ``first_token_id``: the token its prefill emits instead of a sampled one (a retried
        prefill whose first token a client already has); None = sampled."""
        sampling = check_sampling(sampling)
        k = check_spec_tokens(num_spec_tokens, self.k)
        vocab = self.target.config.vocab_size
        prompt_ids = encode_prompt(prompt, self.tokenizer, vocab)
        if first_token_id is not None and not 0 <= first_token_id < vocab:
            raise ValueError(f"first_token_id: {first_token_id} is outside the vocabulary [0, {vocab})")
        request_id = self._new_id(request_id)
        check_fits(len(prompt_ids), sampling.max_tokens, self.max_model_len, self.manager)
        req = Request(request_id, prompt_ids, sampling, self._seed(sampling), prefill_only, num_spec_tokens=k)
        req.forced_first = first_token_id
        self._constrain(req)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def add_prefilled(
        self,
        request_id: str,
        prompt_ids: list[int],
        aux: AuxState,
        sampling: SamplingParams | None = None,
        num_spec_tokens: int | None = None,
    ) -> None:
        """Start decoding a request whose pages were reserved (:meth:`reserve`) and filled
        by a transfer. The first token's logprobs (when asked for) came with the prefill:
        its entry is None."""
        sampling = check_sampling(sampling)
        k = check_spec_tokens(num_spec_tokens, self.k)
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if not self.manager.has_request(request_id):
            raise ValueError(f"request_id: {request_id!r} has no allocated pages")
        n = aux.prompt_len
        if n != len(prompt_ids) or n < 1:
            raise ValueError(f"aux: prompt_len {n} does not match {len(prompt_ids)} prompt tokens")
        check_fits(n, sampling.max_tokens, self.max_model_len, self.manager)
        origin = "transferred" if self.config.layout == KVLayout.UNIFIED else "cold"
        req = Request(
            request_id, prompt_ids, sampling, self._seed(sampling), origin=origin, num_spec_tokens=k
        )
        self._constrain(req)  # a fresh matcher: the first token is fed as it is appended
        hidden = aux.hidden.reshape(1, -1).to(self.device, self.config.torch_dtype)
        self.progress.start_prefilled(req, aux, hidden)

    def check_reserve(self, request_id: str, prompt_len: int, prompt_ids: Sequence[int] = ()) -> None:
        """Refuse a reservation the engine can never take: ValueError naming the field,
        RequestExists when ``request_id`` holds pages or runs already."""
        check_prompt_len(prompt_len, self.max_model_len)
        if request_id in self.requests or self.manager.has_request(request_id):
            raise RequestExists(f"request_id: {request_id!r} is reserved")
        check_prompt_ids(prompt_ids, prompt_len, self.target.config.vocab_size)

    def reserve(self, request_id: str, prompt_len: int, prompt_ids: Sequence[int] = ()) -> Reservation | None:
        """Pages for a request whose prompt KV will arrive by transfer, to continue with
        :meth:`add_prefilled`; None when they do not fit now. With ``prompt_ids``, what
        the prefix cache holds of the prompt is reused (and named held). Refuses what
        :meth:`check_reserve` refuses."""
        self.check_reserve(request_id, prompt_len, prompt_ids)
        return self.manager.reserve_for_transfer(request_id, prompt_len, prompt_ids)

    def holds_reservation(self, request_id: str) -> bool:
        """Whether ``request_id`` holds reserved pages that no :meth:`add_prefilled` took over
        (not the pages of a finished request an unread step may still write)."""
        return (
            request_id not in self.requests
            and self.manager.has_request(request_id)
            and not self.overlapped.holds(request_id)
        )

    def release_reservation(self, request_id: str) -> bool:
        """Free the pages of a reservation no :meth:`add_prefilled` took over; whether it did."""
        if not self.holds_reservation(request_id):
            return False
        self.manager.free(request_id)
        return True

    def release(self, request_id: str) -> None:
        """Free a parked prefill-only request's pages (offering them to the prefix cache)."""
        req = self.requests.get(request_id)
        if req is None or req.status is not Status.PARKED:
            raise ValueError(f"request_id: {request_id!r} is not a parked prefill")
        self.manager.free(request_id, req.tokens[: req.cacheable_len])
        del self.requests[request_id]

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its final output comes with the next step."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status is Status.PARKED:
            self.release(request_id)
            return True
        req.finish_reason = "abort"
        self.progress.finish(req)
        return True

    @property
    def aux_hidden_size(self) -> int:
        """Hidden values a prefilled request's aux state carries: the drafter's input
        features at the last prompt position, or none when no drafter runs."""
        return self.drafter.config.hidden_size if self.drafter is not None else 0

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.out.has_pending()

    def cache_stats(self) -> CacheStats:
        return self.manager.stats()

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting) requests of the scheduler."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        """One scheduled step under the config's ``scheduling_policy``; no request is in
        both phases, so the policy changes the forwards' shapes, never a request's tokens.
        With ``overlap``, a step may end with its successor launched and not yet read: the
        next call reads it (``device/overlap.py``); outputs are never held back by it."""
        if self.overlapped.in_flight is not None and self.overlapped.go_on():
            self.last_step = "overlapped"
            return self.out.flush()
        plan = self.scheduler.schedule()
        policy = self.config.scheduling_policy
        self.last_step = step_kind(policy, bool(plan.decode), bool(plan.prefill))
        if self.last_step == "mixed":
            self._mixed(plan.decode, plan.prefill)
        elif policy == "prefill-first":
            self._prefill(plan.prefill)
            self._decode(plan.decode)
        else:
            self._decode(plan.decode)
            self._prefill(plan.prefill)
        return self.out.flush()

    def generate(
        self, prompts: list[str | list[int]], sampling: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion; final outputs in prompt order."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling: {len(params)} entries for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for p, s in zip(prompts, params, strict=True):
                ids.append(self.add_request(p, s))
        except ValueError:
            for i in ids:  # all or nothing: drop the ones already queued
                self.abort(i)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids) and self.has_unfinished():
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[i] for i in ids]

    # ------------------------------------------------------------ step phases
    # Prefill chunks and verify blocks share one target forward only under the mixed
    # policy (config.default_policy): a varlen batch padded to its longest query (the CPU
    # reference attention) would make every verify block as costly as a prefill chunk.

    def _decode(self, decode: list[Request]) -> None:
        if not decode:
            return
        k = max(r.num_spec_tokens for r in decode)
        device = not any(r.grammar is not None for r in decode)  # grammars mask on the host
        rule = self.adaptive if self.adaptive is not None and k and device and greedy_only(decode) else None
        if rule is not None:
            k = min(k, rule.choose(len(decode)))
        start = time.perf_counter()
        plan = device_step_fits(self.runner, decode, k) if self.config.device_draft_chain else None
        if plan is not None and self.overlapped.start(plan, decode, k):
            self.last_step = "overlapped" if self.last_step == "decode" else self.last_step
            return
        step = device_step(self.runner, plan, decode, k, self.config.forced_acceptance) if plan else None
        if step is None:
            step = self._general_decode(decode, k)
        if rule is not None:  # the step ended with its host read: this is its cost
            rule.record(len(decode), k, time.perf_counter() - start, sum(map(len, step.emitted)))
        for i, req in enumerate(decode):
            self.progress.advance_decode(req, step, i)

    def _general_decode(
        self, decode: list[Request], k: int, prefill: Sequence[tuple[Request, PrefillSpan]] = ()
    ) -> StepResult:
        """Any batch: the eager draft chain, the verify forward, rejection sampling.
        ``prefill`` chunks join the verify forward, after the decode rows (the mixed
        policy): the result's ``offsets`` then go on over their rows."""
        drafts = draft(self.runner, decode, k, self.out.eos_ids) if self.drafter is not None else None
        spans = verify_spans(decode, drafts) + prefill_spans(prefill)
        run = self.runner.run_target(spans)
        offsets = [0, *itertools.accumulate(len(s.token_ids) for s in spans)]
        emitted, logprobs = verify(
            self.runner, decode, drafts, run, offsets, self.out.eos_ids, self.config.forced_acceptance
        )
        return StepResult(emitted, logprobs, run, offsets)

    def _mixed(self, decode: list[Request], prefill: list[tuple[Request, PrefillSpan]]) -> None:
        """Decode rows and prefill chunks in one target forward, then each phase's
        bookkeeping as when they run apart. It takes the general path: the device step's
        graphs (and the adaptive K rule) serve decode-only steps; a decode graph runs it
        only when every chunk has the graph's query length (graphs honour write_start)."""
        step = self._general_decode(decode, max(r.num_spec_tokens for r in decode), prefill)
        for i, req in enumerate(decode):
            self.progress.advance_decode(req, step, i)
        self._prefill_ran(prefill, step.run, step.offsets[len(decode) :])

    def _prefill(self, prefill: list[tuple[Request, PrefillSpan]]) -> None:
        if not prefill:
            return
        spans = prefill_spans(prefill)
        run = self.runner.run_target(spans)
        self._prefill_ran(prefill, run, [0, *itertools.accumulate(len(s.token_ids) for s in spans)])

    def _prefill_ran(
        self, prefill: list[tuple[Request, PrefillSpan]], run: TargetRun, offsets: list[int]
    ) -> None:
        """The chunks' rows are ``run``'s offsets[i]:offsets[i + 1]: the drafter's KV over
        them, their progress, and the first token of each prompt they complete."""
        if self.drafter is not None:
            draft_prefill(self.runner, prefill, run, offsets)
        self.progress.chunks_ran(prefill, run, offsets)
        done = [(i, req) for i, (req, span) in enumerate(prefill) if span.end == req.prefill_end]
        if not done:
            return
        reqs = [req for _, req in done]
        last = run.hidden[[offsets[i + 1] - 1 for i, _ in done]]
        tokens, logprobs = sample_first(self.runner, reqs, last, self.out.eos_ids)
        for req, token, lp in zip(reqs, tokens, logprobs, strict=True):
            self.progress.start_decode(req, token, lp)

    # ------------------------------------------------------------ setup and checks

    def _capture_graphs(self) -> None:
        """The decode step's CUDA graphs (and the adaptive K rule they enable); what they
        took is logged against the KV budget's estimate when that was derived."""
        c = self.config
        reserved = torch.cuda.memory_reserved(self.device)
        self.runner.graphs = capture_decode_graphs(
            self.runner, self.k + 1, c.max_num_seqs, self.max_model_len
        )
        if self.memory is not None:
            graphs_taken(self.device, reserved, self.memory.graphs)
        if c.adaptive_k and self.k:
            self.adaptive = self.new_adaptive_k()

    def forget_warm_up(self) -> None:
        """Everything finished requests (the warm-up's) left in the engine's state, back to a
        fresh engine's: the prefix cache and its counters, the speculative and preemption
        counters, the graphs' replay counters, the adaptive K rule, an unread step."""
        self.overlapped.settle()
        self.manager.reset_prefix_cache()
        self.manager.reset_stats()
        self.progress.stats.clear()
        self.scheduler.num_preemptions = 0
        self.last_step = ""
        if self.adaptive is not None:
            self.adaptive = self.new_adaptive_k()
        if self.runner.graphs is not None:
            self.runner.graphs.reset_replays()

    def new_adaptive_k(self) -> AdaptiveK:
        """The per-step K rule as it starts: no step measured yet."""
        return AdaptiveK(self.k, self.config.max_num_seqs)

    def _constrain(self, req: Request) -> None:
        """The request's grammar matcher when it asks for structured output (ValueError
        naming ``structured`` when its constraint does not compile)."""
        if req.sampling.structured is not None:
            req.grammar = self.grammars.matcher(req.sampling.structured)

    def _new_id(self, request_id: str | None) -> str:
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        return request_id

    def _seed(self, sampling: SamplingParams) -> int | None:
        if sampling.greedy:
            return None
        return request_seed(
            sampling.seed if sampling.seed is not None else self._seeds.getrandbits(SEED_BITS)
        )


def prefill_spans(prefill: Sequence[tuple[Request, PrefillSpan]]) -> list[Span]:
    """The target spans of a step's prefill chunks (KV written from each one's write start)."""
    return [
        Span(r.request_id, s.start, r.token_range(s.start, s.end), r.target_write_start) for r, s in prefill
    ]


def step_kind(policy: str, decode: bool, prefill: bool) -> str:
    """What forwards a step of ``policy`` runs: "decode", "prefill", "mixed" (one forward
    of both), "decode+prefill" (two), or "" (none)."""
    if decode and prefill:
        return "mixed" if policy == "mixed" else "decode+prefill"
    return "decode" if decode else "prefill" if prefill else ""
