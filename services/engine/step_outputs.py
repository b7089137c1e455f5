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
    (their matching needs its text); else outputs carry the whole output so far."""

    def __init__(
        self, tokenizer: Tokenizer, eos_ids: frozenset[int], speculative: bool, delta: bool = False
    ) -> None:
        self.tokenizer, self.eos_ids, self.speculative = tokenizer, eos_ids, speculative
        self.delta = delta
        self._touched: dict[str, Request] = {}
        self._new: dict[str, list[int]] = {}
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
        outs = [self._output(req, self._new[rid]) for rid, req in self._touched.items()]
        self._touched, self._new = {}, {}
        return outs

    def _detokenizer(self, req: Request) -> Detokenizer | None:
        detok = self._detok.get(req.request_id)
        if detok is None and (not self.delta or req.sampling.stop):
            detok = self._detok[req.request_id] = Detokenizer(self.tokenizer)
        return detok

    def _touch(self, req: Request) -> list[int]:
        self._touched[req.request_id] = req
        return self._new.setdefault(req.request_id, [])

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
