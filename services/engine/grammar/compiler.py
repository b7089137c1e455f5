"""Compiling constraints once: a fresh llguidance matcher per distinct constraint, copied
for every request that asks for it.

The vocabulary is the target's logits width (``vocab``, at least the tokenizer's); the
grammar's end is the model's end-of-sequence tokens. The llguidance tokenizer is built on
the first constrained request (it walks the whole vocabulary once).
"""

from __future__ import annotations

from collections import OrderedDict

import llguidance

from services.engine.grammar.matcher import RequestGrammar
from services.grammar import Constraint, ConstraintError, check_constraint
from services.tokenization.tokenizer import Tokenizer

CACHE_SIZE = 256  # distinct constraints kept compiled (least recently used dropped)


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab: int, eos_ids: frozenset[int]) -> None:
        self.tokenizer, self.vocab, self.eos_ids = tokenizer, vocab, eos_ids
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self.compiled = 0  # constraints compiled so far (cache misses)

    def matcher(self, constraint: Constraint) -> RequestGrammar:
        """A new request's matcher, at the grammar's start. Raises ValueError naming
        ``structured`` for a constraint that does not compile."""
        base = self._cache.get(constraint)
        if base is None:
            base = self._compile(constraint)
        self._cache.move_to_end(constraint)
        return RequestGrammar(base.deep_copy(), self.vocab, self._tokenizer().vocab_size, self.eos_ids)

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        try:
            text = check_constraint(constraint)
        except ConstraintError as e:
            raise ValueError(f"structured: {e}") from None
        base = llguidance.LLMatcher(self._tokenizer(), text, log_level=0)
        if base.is_error():
            raise ValueError(f"structured: {base.get_error().splitlines()[0]}")
        self.compiled += 1
        self._cache[constraint] = base
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return base

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            backend = self.tokenizer.backend
            n_vocab = max(self.vocab, backend.get_vocab_size(with_added_tokens=True))
            eos = sorted(t for t in self.eos_ids if t < n_vocab) or None  # None: the tokenizer's
            try:
                self._ll_tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)
            except Exception as e:  # the grammar engine cannot read this tokenizer
                raise ValueError(
                    f"structured: the grammar engine cannot read this model's tokenizer: {e}"
                ) from None
        return self._ll_tokenizer
