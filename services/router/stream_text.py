"""A request's streamed text: incremental detokenization, then stop strings trimmed.

The engine's rule for ``min_tokens`` (stopping.append_tokens): a stop string counts only
where it begins after the text of the first ``min_tokens`` tokens. So that text is emitted
as decoded, never searched nor withheld, and the StopTrimmer sees only what follows it.
"""

from __future__ import annotations

from services.router.stop_trimmer import StopTrimmer
from services.tokenization.detokenizer import Detokenizer
from services.tokenization.tokenizer import Tokenizer


class StreamText:
    def __init__(
        self, tokenizer: Tokenizer, stops: list[str], min_tokens: int = 0, include_stop: bool = False
    ) -> None:
        """``include_stop``: the text keeps the stop string it ends with."""
        self.detok = Detokenizer(tokenizer)
        self.trimmer = StopTrimmer(stops, include_stop)
        self.protected_left = min_tokens  # tokens whose text no stop string may begin in

    def push(self, token_ids) -> str:
        """The text the tokens complete, cut before the first stop string."""
        ids = list(token_ids)
        n = min(self.protected_left, len(ids))
        self.protected_left -= n
        head = self.detok.push(ids[:n]) if n else ""
        tail = self.trimmer.feed(self.detok.push(ids[n:])) if len(ids) > n else ""
        return head + tail

    def flush(self) -> str:
        """At the end of the request: the text still held, trimmed as the rest."""
        return self.trimmer.feed(self.detok.flush()) + self.trimmer.flush()
