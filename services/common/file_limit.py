"""The process's open-file limit, raised to what the system allows before serving.

A common default soft limit is 1,024 file descriptors, which 1,024 HTTP clients (the
router's connection cap) exhaust before the cap: then gRPC clients and workers cannot
connect either (EMFILE). The soft limit may be raised up to the hard one without
privileges; the HTTP server then caps its connections below what is left.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_file_limit() -> int:
    """Set the soft RLIMIT_NOFILE to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, e)
        return soft
    log.info("open-file limit raised from %d to %d", soft, hard)
    return hard
