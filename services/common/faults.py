"""Fault injection for reliability tests: named delays read from ``TANDEM_FAULTS``.

``TANDEM_FAULTS="prefill.before_send=2,engine.step=0.05"`` makes the prefill worker wait 2 s
before pushing pages and every engine step take 50 ms longer; ``worker.stats`` delays every
Stats answer; a name ending in ``_once`` (read through ``once``) delays only the first time
its point is reached, e.g. ``decode.before_receive_once=3`` stalls one reservation's receive.
Unset, every delay is 0.
"""

from __future__ import annotations

import os


def delays(spec: str | None = None) -> dict[str, float]:
    spec = os.environ.get("TANDEM_FAULTS", "") if spec is None else spec
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, value = item.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"TANDEM_FAULTS: {item!r} is not name=seconds") from None
    return out


FAULTS = delays()


_SPENT: set[str] = set()


def delay(name: str) -> float:
    """Seconds to wait at the named point (0 unless injected)."""
    return FAULTS.get(name, 0.0)


def once(name: str) -> float:
    """Seconds to wait at the named point the first time this process reaches it; 0 after
    (and 0 unless injected): one poisoned step, then normal service."""
    if name in _SPENT:
        return 0.0
    _SPENT.add(name)
    return delay(name)
