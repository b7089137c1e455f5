"""Per-step bookkeeping of what each request gained, turned into RequestOutputs."""

from __future__ import annotations

from services.engine.request import Request, RequestOutput, Status
from services.engine.stopping import append_tokens, output_text
from services.tokenization.detokenizer import Detokenizer
from services.tokenization.tokenizer import Tokenizer


class StepOutputs:
    """Holds one Detokenizer per request that has output, dropped once it finishes.
    ``delta`` (config.OUTPUT_KINDS): each output carries only the step's new token ids and
    logprobs and no text, and a Detokenizer is kept only for a request with stop strings
    (their matching needs its text); else outputs carry the whole output so far.

    ``interval`` (EngineConfig.stream_interval): a running request's tokens are held back
    until at least that many gathered since its last output; its first token (no output came
    before) and its finish are never held. A held request's tokens join its next step's, so
    outputs (delta ones included) are the same tokens in fewer, larger pieces."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_ids: frozenset[int],
        speculative: bool,
        delta: bool = False,
        interval: int = 1,
    ) -> None:
        self.tokenizer, self.eos_ids, self.speculative = tokenizer, eos_ids, speculative
        self.delta, self.interval = delta, interval
        self._touched: dict[str, Request] = {}
        self._new: dict[str, list[int]] = {}
        self._held: dict[str, list[int]] = {}  # running requests' tokens since their last output
        self._detok: dict[str, Detokenizer] = {}

    def append(self, req: Request, token_ids: list[int]) -> None:
        """Append under the stop rules (see stopping.append_tokens)."""
        appended = append_tokens(req, token_ids, self._detokenizer(req), self.eos_ids)
        self._touch(req).extend(appended)

    def park(self, req: Request) -> None:
        """A prefill-only request: its one token was appended without stop checks."""
        detok = self._detokenizer(req)
        if detok is not None:
            detok.push([req.output_ids[-1]])
        self._touch(req).append(req.output_ids[-1])

    def finish(self, req: Request) -> None:
        self._touch(req)

    def has_pending(self) -> bool:
        return bool(self._touched)

    def flush(self) -> list[RequestOutput]:
        outs = []
        for rid, req in self._touched.items():
            new = self._new[rid]
            if self._holds(req, new):
                self._held[rid] = new
            else:
                outs.append(self._output(req, new))
        self._touched, self._new = {}, {}
        return outs

    def _holds(self, req: Request, new: list[int]) -> bool:
        """Whether ``new`` waits for more: too few, the request running, and not its first."""
        if len(new) >= self.interval or req.status in (Status.PARKED, Status.FINISHED):
            return False
        return len(req.output_ids) > len(new)

    def _detokenizer(self, req: Request) -> Detokenizer | None:
        detok = self._detok.get(req.request_id)
        if detok is None and (not self.delta or req.sampling.stop):
            detok = self._detok[req.request_id] = Detokenizer(self.tokenizer)
        return detok

    def _touch(self, req: Request) -> list[int]:
        rid = req.request_id
        self._touched[rid] = req
        if rid not in self._new:
            self._new[rid] = self._held.pop(rid, [])
        return self._new[rid]

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        parked = req.status is Status.PARKED
        finished = parked or req.status is Status.FINISHED
        detok = self._detok.pop(req.request_id, None) if finished else self._detok.get(req.request_id)
        wants_logprobs = req.sampling.logprobs is not None
        if self.delta:
            token_ids, text = new, ""
            logprobs = req.output_logprobs[len(req.output_logprobs) - len(new) :] if wants_logprobs else None
        else:
            token_ids = list(req.output_ids)
            text = output_text(req, detok, finished) if detok is not None else ""
            logprobs = list(req.output_logprobs) if wants_logprobs else None
        return RequestOutput(
            req.request_id,
            new,
            token_ids,
            text,
            finished,
            "prefilled" if parked else req.finish_reason,
            req.usage(self.speculative),
            req.aux if parked else None,
            logprobs,
        )
