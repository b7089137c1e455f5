"""The transfer backends, by the name their endpoints publish: one line per backend.

:func:`new_transport` is the factory every :class:`~kvcore.transfer.rank.RankTransfer` (so
every agent) builds its transport from when it is given none.
"""

from __future__ import annotations

from kvcore.transfer.transport import Transport, TransportFactory
from kvcore.transfer.ucx import UcxTransport

BACKENDS: dict[str, TransportFactory] = {
    UcxTransport.backend: UcxTransport,
}
DEFAULT_BACKEND = UcxTransport.backend


def new_transport(backend: str = DEFAULT_BACKEND) -> Transport:
    """A new transport of ``backend``, not yet started; ValueError naming an unknown one."""
    factory = BACKENDS.get(backend)
    if factory is None:
        raise ValueError(f"backend: {backend!r} is not a transfer backend (known: {sorted(BACKENDS)})")
    return factory()
