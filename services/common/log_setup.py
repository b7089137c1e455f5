"""Python logging of a Tandem process, configured once at its start (``--log-level``).

Every process (the router, each worker, each tensor-parallel rank, ``tandem up``) calls
:func:`configure_logging` from its entry point, before anything logs: one handler on the
root logger, to stderr, one line per record::

    2026-12-03 10:15:02,118 WARNING decode-1 services.decode.server: reservation of ...

time, level, who (the process: ``router``, a worker's instance id, a rank's
``<id>/rank<r>``) and the logger's name. ``tandem up`` (deploy/local.py) merges each
child's stderr into the stdout it captures, so these lines reach its log capture, and
``TANDEM_ECHO_LOGS=1`` echoes them. Loads nothing heavy: the router and the launchers'
option checks import it.
"""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LOG_LEVEL = "INFO"


def log_format(who: str) -> str:
    """The line format of process ``who`` (a ``%`` in it is kept literally)."""
    return "%(asctime)s %(levelname)s " + who.replace("%", "%%") + " %(name)s: %(message)s"


def configure_logging(level: str, who: str) -> None:
    """Send every record at ``level`` or above to stderr, formatted for process ``who``;
    replaces the root logger's handlers, so a second call reconfigures rather than doubles
    the lines. ValueError naming log_level for a level outside LOG_LEVELS."""
    if level not in LOG_LEVELS:
        raise ValueError(
            f"log_level: must be {', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]}, got {level!r}"
        )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(log_format(who)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
