"""Stop strings in streamed text: a stream's text ends *before* the first stop string.

Workers end a request when a stop string appears, but the tokens already streamed decode
to text that carries the stop string itself. ``StopTrimmer`` sits on the router's streamed
text (gRPC and HTTP alike): it withholds any tail that could still begin a stop string, and
cuts everything from the first match on (or after it: ``include_stop``, vLLM's
include_stop_str_in_output). Token ids are not cut.
"""

from __future__ import annotations


class StopTrimmer:
    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop  # the text ends after the first stop string, not before
        self.pending = ""  # withheld: a tail that is a proper prefix of some stop string
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of ``text`` that can be emitted now."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buffer = self.pending + text
        hits = [(i, len(s)) for s in self.stops if (i := buffer.find(s)) >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            start, length = min(hits)
            return buffer[: start + length] if self.include_stop else buffer[:start]
        held = self._held_length(buffer)
        self.pending = buffer[len(buffer) - held :]
        return buffer[: len(buffer) - held]

    def flush(self) -> str:
        """At the end of the request: whatever was withheld and turned out not to stop it."""
        text, self.pending = self.pending, ""
        return "" if self.stopped else text

    def _held_length(self, buffer: str) -> int:
        """The longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        for n in range(min(len(buffer), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = buffer[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
