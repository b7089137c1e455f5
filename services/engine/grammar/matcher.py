"""One request's grammar state, and the token masks of its logits rows.

Invariant: the matcher has consumed exactly ``output_ids[:consumed]`` of its request (the
tokens emitted so far; under disaggregation the decode worker's fresh matcher re-feeds the
first token, so its state equals the prefill's). A row's mask is computed by consuming the
row's extra tokens (drafts before it) on top of that, then rolling them back: masks never
move the state, only :meth:`feed` does.

A row whose extra tokens the grammar refuses (a draft outside it, which the row before
rejects with certainty) bans nothing: it is never the one that emits. Where the grammar is
stopped (complete, or after its end), only the end-of-sequence tokens are allowed.
"""

from __future__ import annotations

import llguidance
import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


class RequestGrammar:
    def __init__(
        self, matcher: llguidance.LLMatcher, vocab: int, n_vocab: int, eos_ids: frozenset[int]
    ) -> None:
        """``vocab``: the logits' width; ``n_vocab``: the matcher tokenizer's (>= vocab)."""
        self.matcher, self.vocab, self.n_vocab, self.eos_ids = matcher, vocab, n_vocab, eos_ids
        self.consumed = 0  # output tokens fed so far

    def feed(self, output_ids: list[int]) -> bool:
        """Consume the output tokens not fed yet; False when the grammar refused one (the
        matcher is then in error and the request must end)."""
        new = output_ids[self.consumed :]
        self.consumed = len(output_ids)
        return not new or self.matcher.consume_tokens(new)

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()

    def cut(self, tokens: list[int]) -> list[int]:
        """``tokens`` up to and including the first end-of-sequence token: the grammar
        ends the request there, whatever ``ignore_eos`` says."""
        for i, t in enumerate(tokens):
            if t in self.eos_ids:
                return tokens[: i + 1]
        return tokens

    def banned(self, extras: list[list[int]]) -> torch.Tensor:
        """[len(extras), vocab] bool: True where row i (after ``extras[i]``) may not go."""
        bitmask = torch.full((len(extras), -(-self.n_vocab // 32)), -1, dtype=torch.int32)  # [rows, words]
        held: list[int] = []  # extra tokens consumed on top of the output
        dead = []  # rows whose extras the grammar refuses
        for i, extra in enumerate(extras):
            common = _common_prefix(held, extra)
            if len(held) > common:
                self.matcher.rollback(len(held) - common)
                held = held[:common]
            rest = extra[common:]
            n = self.matcher.validate_tokens(rest) if rest else 0
            if n and self.matcher.consume_tokens(rest[:n]):
                held += rest[:n]
            if n < len(rest):
                dead.append(i)
                continue
            fill_mask(self.matcher, bitmask[i])
        if held:
            self.matcher.rollback(len(held))
        allowed = ((bitmask[:, :, None] >> _SHIFTS) & 1).view(len(extras), -1)[:, : self.vocab].bool()
        banned = ~allowed
        if dead:
            banned[dead] = False
        banned[banned.all(dim=-1)] = False  # nothing allowed: leave the row to the model
        return banned


def fill_mask(matcher: llguidance.LLMatcher, row: torch.Tensor) -> None:
    """The matcher's next-token bitmask into ``row`` (contiguous int32 on the CPU, a bit per
    token id). What ``llguidance.torch.fill_next_token_bitmask`` does; that module is not
    imported: its ``torch.compile`` kernel pulls in torch._dynamo, about 2 s of every
    process's start."""
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
