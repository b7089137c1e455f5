"""Python logging of a Tandem process, configured once at its start (``--log-level``,
``--log-format``).

Every process (the router, each worker, each tensor-parallel rank, ``tandem up``) calls
:func:`configure_logging` from its entry point, before anything logs: one handler on the
root logger, to stderr, one line per record. ``text`` (the default)::

    2026-12-03 10:15:02,118 WARNING decode-1 services.decode.server [cmpl-42]: reservation of ...

time, level, who (the process: ``router``, a worker's instance id, a rank's
``<id>/rank<r>``), the logger's name and, for a line about a request, its id in brackets.
``json``: one JSON object per line with the keys ``time`` (ISO 8601, UTC), ``level``,
``process``, ``logger``, ``message``, ``request_id`` (only on a line about a request),
``exception`` (only with a traceback) and, for the request and stats lines, their fields
as keys of their own (a record's ``extra={"fields": {...}}``). The request is the one bound in
services/common/request_context.py. ``tandem up`` (deploy/local.py) merges each child's
stderr into the stdout it captures, so these lines reach its log capture, and
``TANDEM_ECHO_LOGS=1`` echoes them. Loads nothing heavy: the router and the launchers'
option checks import it.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from services.common.request_context import REQUEST_ID

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LOG_LEVEL = "INFO"
LOG_FORMATS = ("text", "json")
DEFAULT_LOG_FORMAT = "text"


def log_format(who: str) -> str:
    """The text line format of process ``who`` (a ``%`` in it is kept literally)."""
    who = who.replace("%", "%%")
    return "%(asctime)s %(levelname)s " + who + " %(name)s%(request_tag)s: %(message)s"


class RequestTag(logging.Filter):
    """Puts the bound request's id on every record: ``request_id`` ("" when none) and
    ``request_tag`` (`` [id]`` or "") for the text format. A record that names its own
    ``request_id`` (``extra=``) keeps it."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        record.request_id = rid
        record.request_tag = f" [{rid}]" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record (the keys in the module docstring)."""

    def __init__(self, who: str) -> None:
        super().__init__()
        self.who = who

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "process": self.who,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if rid := getattr(record, "request_id", ""):
            line["request_id"] = rid
        for key, value in (getattr(record, "fields", None) or {}).items():
            line.setdefault(key, value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def check_log_options(level: str, fmt: str = DEFAULT_LOG_FORMAT) -> None:
    """ValueError naming log_level or log_format for a value outside the choices."""
    for name, value, choices in (("log_level", level, LOG_LEVELS), ("log_format", fmt, LOG_FORMATS)):
        if value not in choices:
            raise ValueError(f"{name}: must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}")


def configure_logging(level: str, who: str, fmt: str = DEFAULT_LOG_FORMAT) -> None:
    """Send every record at ``level`` or above to stderr, formatted (``fmt``: text or json)
    for process ``who``; replaces the root logger's handlers, so a second call reconfigures
    rather than doubles the lines. ValueError naming log_level or log_format for a value
    outside the choices."""
    check_log_options(level, fmt)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestTag())
    handler.setFormatter(JsonFormatter(who) if fmt == "json" else logging.Formatter(log_format(who)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
