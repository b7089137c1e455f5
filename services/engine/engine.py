"""The engine: one process serving many requests with speculative decoding.

    engine = Engine(EngineConfig(model="models/tiny-target", drafter="models/tiny-drafter"))
    outputs = engine.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))

Streaming use: ``add_request`` then call ``step`` while ``has_unfinished``; each step
returns the news of every request it touched. For disaggregated serving, a prefill worker
adds requests with ``prefill_only=True`` (they finish with reason "prefilled", an
``AuxState`` and their pages kept until ``release``), and a decode worker continues them
with ``add_prefilled`` once their pages have landed.
"""

from __future__ import annotations

import itertools
import random

import torch

from kvcore import KVLayout
from kvcore.aux_state import AuxState
from services.engine.checks import cache_config, check_fits, check_sampling, encode_prompt, eos_ids
from services.engine.config import EngineConfig
from services.engine.lockstep import attach_lockstep, make_manager
from services.engine.models import load_drafter, load_target
from services.engine.parallel import rank_device, tensor_parallel
from services.engine.rejection import rejection_sample
from services.engine.request import PrefillSpan, Request, RequestOutput, Status, TokenLogprob
from services.engine.row_sampling import row_params, token_logprobs
from services.engine.runner import ModelRunner, Span, TargetRun
from services.engine.sampler import probs_for_rows, sample
from services.engine.sampling import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.speculative import Drafts, draft, verify_spans
from services.engine.stats import SpecStats
from services.engine.step_outputs import StepOutputs
from tokenization.tokenizer import load_tokenizer


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tp = tensor_parallel(config.tp_size)
        self.device = rank_device(config.device, self.tp)
        self.target = load_target(config.model, self.device, config.torch_dtype, self.tp)
        self.drafter = None
        if config.speculative:
            self.drafter = load_drafter(config.drafter, self.device, config.torch_dtype, self.tp)
            self.drafter.config = self.drafter.config.check_target(self.target.config)
        self.k = config.num_spec_tokens if self.drafter is not None else 0
        self.max_model_len = config.max_model_len or self.target.config.max_position_embeddings
        self.manager = make_manager(
            cache_config(config, self.target, self.drafter, self.k),
            self.target,
            self.drafter,
            self.device,
            self.tp,
        )
        self.runner = ModelRunner(self.target, self.drafter, self.manager, self.device)
        attach_lockstep(self.runner, self.tp)
        if config.cuda_graphs:
            self.runner.capture_cuda_graphs(self.k + 1, config.max_num_seqs, self.max_model_len)
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
            self.tokenizer, eos_ids(config.model, self.target.config, self.tokenizer), self.k > 0
        )
        self.requests: dict[str, Request] = {}
        self.stats: dict[str, SpecStats] = {}
        self._seeds = random.Random(config.seed)
        self._ids = itertools.count()

    # ------------------------------------------------------------ public API

    def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        prefill_only: bool = False,
        num_spec_tokens: int | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError naming the bad field.
        ``num_spec_tokens``: drafts verified per step for this request, 0..K (None = K)."""
        sampling = check_sampling(sampling)
        k = self._spec_tokens(num_spec_tokens)
        prompt_ids = encode_prompt(prompt, self.tokenizer, self.target.config.vocab_size)
        request_id = self._new_id(request_id)
        check_fits(len(prompt_ids), sampling.max_tokens, self.max_model_len, self.manager)
        req = Request(
            request_id, prompt_ids, sampling, self._generator(sampling), prefill_only, num_spec_tokens=k
        )
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
        """Start decoding a request whose pages were reserved with
        ``manager.allocate(request_id, n, num_computed=n)`` and filled by a transfer. The
        first token's logprobs (when asked for) came with the prefill: its entry is None."""
        sampling = check_sampling(sampling)
        k = self._spec_tokens(num_spec_tokens)
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if request_id not in self.manager.requests:
            raise ValueError(f"request_id: {request_id!r} has no allocated pages")
        n = aux.prompt_len
        if n != len(prompt_ids) or n < 1:
            raise ValueError(f"aux: prompt_len {n} does not match {len(prompt_ids)} prompt tokens")
        check_fits(n, sampling.max_tokens, self.max_model_len, self.manager)
        origin = "transferred" if self.config.layout == KVLayout.UNIFIED else "cold"
        req = Request(
            request_id, prompt_ids, sampling, self._generator(sampling), origin=origin, num_spec_tokens=k
        )
        req.status = Status.DECODE
        req.num_computed = req.target_write_start = req.draft_valid = n
        req.pending_start, req.pending_tokens = n, [aux.first_token_id]
        req.pending_features = aux.hidden.reshape(1, -1).to(self.device, self.config.torch_dtype)
        self.requests[request_id] = req
        self._append(req, [aux.first_token_id], [None])
        if req.finish_reason is not None:
            self._finish(req)
            return
        self.scheduler.add_running(req)

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
        self._finish(req)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.out.has_pending()

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.decode:  # decode first: its outputs do not depend on this step's prefills
            self._decode(plan.decode)
        if plan.prefill:
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
    # Prefill chunks and verify blocks run as separate target forwards: a varlen batch
    # padded to its longest query (the CPU reference attention) would make every verify
    # block as costly as a prefill chunk.

    def _decode(self, decode: list[Request]) -> None:
        k = max(r.num_spec_tokens for r in decode)
        drafts = draft(self.runner, decode, k, self.out.eos_ids) if self.drafter is not None else None
        spans = verify_spans(decode, drafts)
        run = self.runner.run_target(spans)
        offsets = [0, *itertools.accumulate(len(s.token_ids) for s in spans)]
        self._finish_decodes(decode, drafts, run, offsets)

    def _prefill(self, prefill: list[tuple[Request, PrefillSpan]]) -> None:
        spans = [
            Span(r.request_id, s.start, r.tokens[s.start : s.end], r.target_write_start) for r, s in prefill
        ]
        run = self.runner.run_target(spans)
        offsets = [0, *itertools.accumulate(len(s.token_ids) for s in spans)]
        if self.drafter is not None:
            self._draft_prefill(prefill, run, offsets)
        self._finish_prefills(prefill, run, offsets)

    def _draft_prefill(self, prefill, run: TargetRun, offsets: list[int]) -> None:
        """Drafter slots of the chunks' positions: slot j reads t_j and f_{j-1}."""
        spans, hidden = [], []
        for i, (req, span) in enumerate(prefill):
            first = (
                req.last_feature
                if req.last_feature is not None and span.start > 0
                else torch.zeros_like(run.features[0])
            )
            hidden += [first[None], run.features[offsets[i] : offsets[i + 1] - 1]]
            spans.append(
                Span(req.request_id, span.start, req.tokens[span.start : span.end], req.draft_write_start)
            )
        self.runner.run_drafter(spans, torch.cat(hidden))

    def _finish_prefills(self, prefill, run: TargetRun, offsets: list[int]) -> None:
        done = [(i, req) for i, (req, span) in enumerate(prefill) if span.end == req.prefill_end]
        for i, (req, span) in enumerate(prefill):
            req.prefill_pos = span.end
            req.num_computed = max(req.num_computed, span.end)
            req.draft_valid = span.end if self.drafter is not None else req.num_computed
            if run.features is not None:
                req.last_feature = run.features[offsets[i + 1] - 1]
            self._release_window(req)
        if not done:
            return
        reqs = [req for _, req in done]
        logits = self.runner.target_logits(run.hidden[[offsets[i + 1] - 1 for i, _ in done]])
        params = row_params(reqs, [[[]] for _ in reqs], logits.shape[-1], self.out.eos_ids, self.device)
        tokens = sample(probs_for_rows(logits, params), [r.generator for r in reqs]).tolist()
        logprobs = self._logprobs(logits, [[t] for t in tokens], reqs)
        for req, token, lp in zip(reqs, tokens, logprobs, strict=True):
            self._start_decode(req, token, lp)

    def _start_decode(self, req: Request, token: int, logprobs: list[TokenLogprob]) -> None:
        n = req.num_computed
        req.pending_start, req.pending_tokens = n, [token]
        if req.last_feature is not None:
            req.pending_features = req.last_feature[None]
        if req.prefill_only:
            req.output_ids.append(token)
            req.output_logprobs.extend(logprobs)
            req.status = Status.PARKED
            hidden = req.last_feature.float().cpu() if req.last_feature is not None else torch.zeros(0)
            req.aux = AuxState(n, token, hidden)
            self.scheduler.remove(req)
            self.out.park(req)
            return
        req.status = Status.DECODE
        self._append(req, [token], logprobs)
        if req.finish_reason is not None:
            self._finish(req)

    def _finish_decodes(
        self, decode: list[Request], drafts: Drafts | None, run: TargetRun, offsets: list[int]
    ) -> None:
        """Verify: row j of request i's block is scored with d_1..d_j counted by its
        penalties and min_tokens (row_sampling.py); request i keeps at most k_i drafts."""
        if not decode:
            return
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in range(len(decode))])
        logits = self.runner.target_logits(run.hidden[rows.to(self.device)])  # [sum(k_i + 1), V]
        ks = [r.num_spec_tokens for r in decode]
        draft_ids = (
            drafts.token_ids
            if drafts is not None
            else torch.zeros(len(decode), 0, dtype=torch.long, device=self.device)
        )
        ids = draft_ids.tolist()
        extras = [[ids[i][:j] for j in range(ks[i] + 1)] for i in range(len(decode))]
        params = row_params(decode, extras, logits.shape[-1], self.out.eos_ids, self.device)
        probs = self._by_position(probs_for_rows(logits, params), ks, draft_ids.shape[1])
        draft_probs = drafts.probs if draft_ids.shape[1] else probs[:, :0]
        num_drafts = torch.tensor(ks, device=self.device) if min(ks) < draft_ids.shape[1] else None
        verdict = rejection_sample(probs, draft_probs, draft_ids, [r.generator for r in decode], num_drafts)
        accepted, nexts = verdict.num_accepted.tolist(), verdict.next_tokens.tolist()
        emitted = [ids[i][: accepted[i]] + [nexts[i]] for i in range(len(decode))]
        logprobs = self._logprobs(logits, emitted, decode, offsets)
        for i, req in enumerate(decode):
            self._advance_decode(req, emitted[i], logprobs[i], run, offsets[i])

    def _by_position(self, probs: torch.Tensor, ks: list[int], k: int) -> torch.Tensor:
        """probs [sum(k_i + 1), V] -> [batch, k + 1, V], request i's rows at 0..k_i (rows past
        k_i are zeros; rejection_sample never reads them)."""
        if all(n == k for n in ks):
            return probs.view(len(ks), k + 1, -1)
        out = probs.new_zeros(len(ks), k + 1, probs.shape[-1])
        batch = torch.tensor([i for i, n in enumerate(ks) for _ in range(n + 1)], device=probs.device)
        pos = torch.tensor([j for n in ks for j in range(n + 1)], device=probs.device)
        out[batch, pos] = probs
        return out

    def _logprobs(
        self,
        logits: torch.Tensor,
        emitted: list[list[int]],
        reqs: list[Request],
        offsets: list[int] | None = None,
    ) -> list[list[TokenLogprob]]:
        """Per request, the logprobs of its emitted tokens (empty unless sampling.logprobs):
        request i's token j was chosen at logits row offsets[i] + j (offsets None: row i)."""
        out: list[list[TokenLogprob]] = [[] for _ in reqs]
        rows, chosen, top_n, owner = [], [], [], []
        for i, req in enumerate(reqs):
            if req.sampling.logprobs is None:
                continue
            start = offsets[i] if offsets is not None else i
            rows += range(start, start + len(emitted[i]))
            chosen += emitted[i]
            top_n += [req.sampling.logprobs] * len(emitted[i])
            owner += [i] * len(emitted[i])
        if rows:
            index = torch.tensor(rows, device=logits.device)
            for i, lp in zip(owner, token_logprobs(logits[index], chosen, top_n), strict=True):
                out[i].append(lp)
        return out

    def _append(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob | None]) -> None:
        """Append under the stop rules, with the logprobs of the tokens kept."""
        before = len(req.output_ids)
        self.out.append(req, tokens)
        if req.sampling.logprobs is not None:
            req.output_logprobs.extend(logprobs[: len(req.output_ids) - before])

    def _advance_decode(
        self, req: Request, emitted: list[int], logprobs: list[TokenLogprob], run: TargetRun, row: int
    ) -> None:
        n, a = req.num_computed, len(emitted) - 1
        req.spec.record(req.num_spec_tokens, a)
        self.stats.setdefault(req.origin, SpecStats()).record(req.num_spec_tokens, a)
        self._append(req, emitted, logprobs)
        req.num_computed = n + a + 1
        req.pending_start, req.pending_tokens = n + 1, emitted
        if run.features is not None:
            req.pending_features = run.features[row : row + a + 1]
        req.draft_valid = n + 1 if self.drafter is not None else req.num_computed
        self._release_window(req)
        if req.finish_reason is not None:
            self._finish(req)

    def _release_window(self, req: Request) -> None:
        """Tell the manager how far KV is final. We report the page-aligned exact prefix,
        not num_computed: the prefix cache keeps whole pages up to there, and the draft
        window ending at that point must still be held for it to be reusable."""
        page = self.manager.page
        self.manager.advance(req.request_id, req.cacheable_len // page * page)

    def _finish(self, req: Request) -> None:
        if req.request_id in self.manager.requests:
            self.manager.free(req.request_id, req.tokens[: req.cacheable_len])
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        self.out.finish(req)
        del self.requests[req.request_id]

    # ------------------------------------------------------------ setup and checks

    def _new_id(self, request_id: str | None) -> str:
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        return request_id

    def _spec_tokens(self, num_spec_tokens: int | None) -> int:
        """A request's drafts per step: None = the engine's K; else 0..K."""
        if num_spec_tokens is None:
            return self.k
        if (
            isinstance(num_spec_tokens, bool)
            or not isinstance(num_spec_tokens, int)
            or not 0 <= num_spec_tokens <= self.k
        ):
            raise ValueError(
                f"num_spec_tokens: must be an integer in [0, {self.k}] (the "
                f"server's K), got {num_spec_tokens!r}"
            )
        return num_spec_tokens

    def _generator(self, sampling: SamplingParams) -> torch.Generator | None:
        if sampling.greedy:
            return None
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
        return torch.Generator(device=self.device).manual_seed(seed)
