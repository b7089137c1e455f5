"""The served-load sweep's workload: the ISL/OSL grid, token-id prompts, Poisson arrivals,
and how many requests a point sends. Pure functions, seeded: every configuration of a sweep
gets the same prompts at the same point."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Lengths:
    """Input tokens (the prompt) and output tokens (max_tokens, EOS ignored) per request."""

    isl: int
    osl: int

    @property
    def name(self) -> str:
        return f"{self.isl}/{self.osl}"


def parse_grid(text: str) -> list[Lengths]:
    """``"512/128,2048/256"`` -> [Lengths(512, 128), Lengths(2048, 256)]; each >= 1."""
    out = []
    for item in text.split(","):
        isl, sep, osl = item.strip().partition("/")
        if not sep or not isl.isdigit() or not osl.isdigit() or int(isl) < 1 or int(osl) < 1:
            raise ValueError(f"--grid: {item!r} is not ISL/OSL (two integers >= 1)")
        out.append(Lengths(int(isl), int(osl)))
    return out


def parse_numbers(text: str, flag: str, kind: type = int) -> list:
    """``"1,8,32"`` -> [1, 8, 32]; each > 0; "" -> []."""
    values = [kind(x) for x in text.split(",") if x.strip()]
    if any(v <= 0 for v in values):
        raise ValueError(f"{flag}: every value must be > 0, got {text!r}")
    return values


def point_seed(seed: int, lengths: Lengths, label: str) -> int:
    """A seed per (sweep seed, ISL/OSL, point label), stable across runs and processes."""
    return zlib.crc32(f"{seed}:{lengths.name}:{label}".encode())


def prompts(count: int, isl: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``isl`` ids drawn uniformly from [0, vocab)."""
    rng, ids = random.Random(seed), range(vocab)
    return [rng.choices(ids, k=isl) for _ in range(count)]


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """Send offsets in seconds: 0 for the first request, then exponential gaps of mean
    1 / ``rate`` (requests/s)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def closed_requests(concurrency: int, rounds: int, minimum: int) -> int:
    """A closed-loop point's requests: ``rounds`` per stream, at least ``minimum``."""
    return max(concurrency * rounds, minimum)


def open_requests(rate: float, seconds: float, minimum: int) -> int:
    """An open-loop point's requests: ``seconds`` of arrivals at ``rate``, at least ``minimum``."""
    return max(round(rate * seconds), minimum)
