"""The request a log line is about: a context variable every process sets where it starts
serving one request, read by the log format (services/common/log_setup.py).

Invariants:
- ``REQUEST_ID`` holds the client's request id (the router's, as its client gave or it
  made): a worker is sent an attempt id ``<request id>#<serial>.<n>``
  (services/router/dispatch.py) and binds the request id inside it, so one id finds a
  request's lines on every process.
- It is set inside the task serving the request (a gRPC handler, an HTTP handler); tasks
  and callbacks started from there inherit it, the engine thread does not. Code that serves
  a request from a task shared with others (an HTTP connection streaming its response)
  binds it only for that span (``about_request``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

REQUEST_ID: ContextVar[str] = ContextVar("tandem_request_id", default="")
_ATTEMPT = re.compile(r"^(.+)#[0-9A-Za-z]+\.\d+$")


def client_request_id(attempt_id: str) -> str:
    """The client's request id inside a worker's attempt id ``<request id>#<serial>.<n>``;
    an id without that suffix is returned as it is."""
    match = _ATTEMPT.match(attempt_id)
    return match.group(1) if match else attempt_id


@contextmanager
def about_request(request_id: str) -> Iterator[None]:
    """Log the lines of this block as about ``request_id``, then as before."""
    token = REQUEST_ID.set(client_request_id(request_id))
    try:
        yield
    finally:
        try:
            REQUEST_ID.reset(token)
        except ValueError:  # closed from another context (a generator finalized elsewhere)
            pass


def bind_request(request_id: str) -> None:
    """Log the rest of this task's lines as about ``request_id`` (an attempt id is cut to
    the client's id)."""
    REQUEST_ID.set(client_request_id(request_id))
