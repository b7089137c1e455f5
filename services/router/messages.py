"""The messages a request's flow sends: to the client (chunk, complete, error) and to its
workers (Prefill, Decode, a forwarded Generate), and the usage it reports.

Invariants:
- Every client message carries the request's id.
- A failed request sends one error message, then one complete with FINISH_REASON_ERROR.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import worker_pb2 as wpb


@dataclass(slots=True)
class Usage:
    """The prefill worker's usage (prompt, cache, transfers) and the decode worker's."""

    prefill: cpb.Usage = field(default_factory=cpb.Usage)
    decode: cpb.Usage = field(default_factory=cpb.Usage)

    def merged(self) -> cpb.Usage:
        """The request's usage: decode's, with the prompt's counts and transfers from
        prefill, and completion tokens counting the prefill's first token."""
        out = cpb.Usage()
        out.CopyFrom(self.decode)
        for name in ("prompt_tokens", "cached_tokens"):
            setattr(out, name, getattr(self.prefill, name))
        out.cached_tokens_per_group.extend(self.prefill.cached_tokens_per_group)
        out.transfers.extend(self.prefill.transfers)
        out.completion_tokens = self.decode.completion_tokens + 1  # + the prefill's first token
        return out


# ---------------------------------------------------------------------- to the client


def chunk(rid: str, token_ids: list[int], text: str, logprobs=()) -> cpb.GenerateResponse:
    """``logprobs``: TokenLogprobs aligned with token_ids, or empty."""
    return cpb.GenerateResponse(
        request_id=rid, chunk=cpb.Chunk(token_ids=token_ids, text=text, logprobs=logprobs)
    )


def complete(rid: str, reason: int, usage: cpb.Usage | None = None) -> cpb.GenerateResponse:
    usage = usage if usage is not None else cpb.Usage()
    return cpb.GenerateResponse(request_id=rid, complete=cpb.Complete(finish_reason=reason, usage=usage))


def aborted(rid: str, usage: cpb.Usage | None = None) -> list[cpb.GenerateResponse]:
    """The complete of an aborted request."""
    return [complete(rid, cpb.FINISH_REASON_ABORT, usage)]


def failed(rid: str, message: str, usage: cpb.Usage | None = None) -> list[cpb.GenerateResponse]:
    """An error message, then the complete with FINISH_REASON_ERROR."""
    return [
        cpb.GenerateResponse(request_id=rid, error=cpb.Error(message=message)),
        complete(rid, cpb.FINISH_REASON_ERROR, usage),
    ]


# ---------------------------------------------------------------------- to the workers


def reserve_request(rid: str, token_ids: list[int]) -> wpb.ReserveRequest:
    return wpb.ReserveRequest(request_id=rid, prompt_len=len(token_ids), prompt_token_ids=token_ids)


def prefill_request(
    rid: str,
    token_ids: list[int],
    request: cpb.GenerateRequest,
    reservation: wpb.Reservation,
    first_token_id: int | None = None,
) -> wpb.PrefillRequest:
    """``first_token_id``: the token a retry must emit first (the client has it); None = sampled."""
    return wpb.PrefillRequest(
        request_id=rid,
        prompt_token_ids=token_ids,
        sampling=request.sampling,
        speculative=request.speculative,
        reservation=reservation,
        first_token_id=first_token_id,
    )


def decode_request(
    rid: str, token_ids: list[int], request: cpb.GenerateRequest, first_token_id: int
) -> wpb.DecodeRequest:
    """Decode the rest after the prefill's first token; the prompt must be the one reserved."""
    return wpb.DecodeRequest(
        request_id=rid,
        prompt_token_ids=token_ids,
        first_token_id=first_token_id,
        sampling=request.sampling,
        speculative=request.speculative,
    )


def forward_request(rid: str, token_ids: list[int], request: cpb.GenerateRequest) -> cpb.GenerateRequest:
    """The request as an aggregated worker serves it: the router's id, token ids."""
    return cpb.GenerateRequest(
        request_id=rid,
        token_ids=cpb.TokenIds(ids=token_ids),
        sampling=request.sampling,
        speculative=request.speculative,
    )
