"""The UCX transport's own plain types: how it reaches a peer (the errors and the endpoint
every backend shares are in :mod:`kvcore.transfer.errors` and :mod:`kvcore.transfer.endpoint`)."""

from __future__ import annotations

import enum


class UcxPath(enum.Enum):
    WORKER_ADDRESS = "worker_address"  # any transport (shm, cma, cuda_ipc); no failure reports
    LISTENER = "listener"  # TCP only; a dead peer raises
