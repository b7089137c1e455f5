"""A request's output under its OutputRules (openai_extras.py): between the router's
messages and the OpenAI response.

- With ``own_text`` the router's chunk text is dropped and this layer's own StreamText runs
  over the same token ids (stop strings trimmed, or kept with include_stop_str_in_output);
  its held-back tail comes in a chunk with no token ids just before the complete.
- At the first of ``stop_token_ids`` the chunk is cut after that token (its text left out
  unless include_stop_str_in_output), ``stopped`` turns true (the caller aborts the
  router's request) and later chunks are dropped; the complete then says
  FINISH_REASON_STOP, ``completion_tokens`` the tokens kept and ``prompt_tokens`` the
  prompt's (an aborted worker reports no usage of its own).
- ``completion_tokens`` counts the tokens passed on so far.

``prepare_prompt`` tokenizes a completion's text prompt in this layer when the router's
tokenization would not do: without the model's special tokens (``add_special_tokens:
false``), or when the prompt's length must be known here (stop token ids, continuous usage
stats); the router then gets token ids.
"""

from __future__ import annotations

from proto.tandem.v1 import client_pb2 as cpb
from services.router import messages as msg
from services.router.openai_extras import OutputRules
from services.router.openai_fields import invalid
from services.router.openai_protocol import OpenAIRequest
from services.router.stream_text import StreamText
from services.router.validation import RequestError, check_text_length
from services.tokenization.tokenizer import Tokenizer


def tokenized_here(request: OpenAIRequest) -> bool:
    """Whether ``prepare_prompt`` has a text prompt to tokenize (see the module doc)."""
    rules = request.rules
    here = not request.add_special_tokens or rules.stop_token_ids or rules.continuous_usage
    return bool(here) and request.generate.WhichOneof("prompt") == "text"


def prepare_prompt(request: OpenAIRequest, tokenizer: Tokenizer | None, max_model_len: int) -> None:
    """The text prompt of a ``tokenized_here`` request as token ids."""
    generate = request.generate
    if tokenizer is None:
        raise invalid("prompt", "this router has no tokenizer; send token ids")
    try:
        check_text_length("prompt", len(generate.text), max_model_len)
    except RequestError as e:
        raise invalid("prompt", str(e).partition(": ")[2]) from None
    ids = tokenizer.encode_text(generate.text, add_special_tokens=request.add_special_tokens)
    generate.token_ids.CopyFrom(cpb.TokenIds(ids=ids))


class RuledOutput:
    def __init__(self, rules: OutputRules, text: StreamText | None, prompt_tokens: int) -> None:
        """``text``: the StreamText of the output (None: chunks carry no text);
        ``prompt_tokens``: the prompt's length, for the usage of a request a stop token ended."""
        self.rules, self.text, self.prompt_tokens = rules, text, prompt_tokens
        self.completion_tokens = 0
        self.stopped = False

    def apply(self, message: cpb.GenerateResponse) -> list[cpb.GenerateResponse]:
        """The messages to pass on for one of the router's."""
        kind = message.WhichOneof("payload")
        if kind == "chunk":
            return self._chunk(message)
        if kind == "complete":
            return self._complete(message)
        return [message]

    def _chunk(self, message: cpb.GenerateResponse) -> list[cpb.GenerateResponse]:
        if self.stopped:
            return []
        ids = list(message.chunk.token_ids)
        kept = self._kept(ids)
        self.completion_tokens += kept
        if not self.rules.own_text:
            return [message]
        if not ids:  # the router's held-back text: this layer holds its own
            return []
        shown = ids[:kept] if not self.stopped or self.rules.include_stop_str else ids[: kept - 1]
        text = self.text.push(shown) if self.text is not None and shown else ""
        return [msg.chunk(message.request_id, ids[:kept], text, message.chunk.logprobs[:kept])]

    def _kept(self, ids: list[int]) -> int:
        """How many of ``ids`` to keep: up to and including the first stop token id."""
        for i, token in enumerate(ids):
            if token in self.rules.stop_token_ids:
                self.stopped = True
                return i + 1
        return len(ids)

    def _complete(self, message: cpb.GenerateResponse) -> list[cpb.GenerateResponse]:
        out = []
        if self.rules.own_text and self.text is not None and (rest := self.text.flush()):
            out.append(msg.chunk(message.request_id, [], rest))
        if self.stopped:
            usage = cpb.Usage()
            usage.CopyFrom(message.complete.usage)
            usage.completion_tokens = self.completion_tokens
            usage.prompt_tokens = self.prompt_tokens or usage.prompt_tokens
            message = msg.complete(message.request_id, cpb.FINISH_REASON_STOP, usage)
        return [*out, message]
