"""Progress of long benchmarks on stderr (tqdm): what is done, the rate and an ETA, so a
ten-minute run does not sit silent. stdout keeps only the results."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def steps(items: Iterable[T], total: int, what: str) -> Iterator[T]:
    """``items`` with a bar of ``total`` steps named ``what``."""
    yield from tqdm(items, total=total, desc=what, file=sys.stderr, dynamic_ncols=True, mininterval=1.0)


def clock(seconds: float, what: str) -> tqdm:
    """A bar over ``seconds`` of wall time: ``update_to(elapsed_s)`` as time passes."""
    bar = tqdm(
        total=round(seconds), desc=what, unit="s", file=sys.stderr, dynamic_ncols=True, mininterval=1.0
    )

    def update_to(elapsed_s: float) -> None:
        bar.update(min(round(elapsed_s), bar.total) - bar.n)

    bar.update_to = update_to
    return bar
