"""The UCX transport's plain types: paths, errors, and how peers reach a transport."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class UcxPath(enum.Enum):
    WORKER_ADDRESS = "worker_address"  # any transport (shm, cma, cuda_ipc); no failure reports
    LISTENER = "listener"  # TCP only; a dead peer raises


class TransferError(RuntimeError):
    """A message could not be moved."""


class TransferTimeout(TransferError, TimeoutError):
    """A message did not complete before its deadline."""


class TransportClosed(TransferError):
    """The transport is closed (or was never started)."""


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    """How peers reach a transport; mirrors the ``UcxEndpoint`` proto message."""

    worker_address: bytes  # UCX worker address, as published in RankInfo
    host: str = ""  # listener host
    port: int = 0  # listener port; 0 = no listener
