"""What every serving process (the router, each worker) is told about its own running:
request lines, the periodic stats line, and how long a graceful shutdown waits.

The flags are deploy/options.py's ``ProcessOptions`` (``--disable-log-requests``,
``--log-stats-interval-s``, ``--shutdown-timeout-s``); the log level and format are set
once at the entry point (services/common/log_setup.py) and are not repeated here.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_STATS_INTERVAL_S = 10.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class ProcessSettings:
    """- ``log_requests``: an INFO line per finished request (a failed one is logged
      whatever this says, once, with its cause);
    - ``stats_interval_s``: seconds between two stats lines; 0 = none;
    - ``shutdown_timeout_s``: on SIGTERM, how long in-flight requests may take to finish
      before the rest are aborted with an error."""

    log_requests: bool = True
    stats_interval_s: float = DEFAULT_STATS_INTERVAL_S
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("stats_interval_s", "shutdown_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
