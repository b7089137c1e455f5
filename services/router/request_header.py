"""``X-Request-Id`` on the router's HTTP API.

- A client's ``X-Request-Id`` names its request: the request's id (in every log line
  about it, on the router and its workers, and the response's ``id``) is
  ``cmpl-<X-Request-Id>`` / ``chatcmpl-<X-Request-Id>``, as vLLM's; it wins over the
  body's ``request_id``.
- Every response echoes the header: the client's value as sent (error responses too: the
  HTTP server's rule, http.py), or, when it sent none, the id the router gave a
  completion or chat request (openai_api.py).
- A value that is empty, longer than MAX_LENGTH or holds a control character is refused
  (400 naming ``x-request-id``).
"""

from __future__ import annotations

from services.router.http_read import HttpError
from services.router.openai_responses import error_json

HEADER = "X-Request-Id"
MAX_LENGTH = 256


def client_request_id(headers: dict[str, str]) -> str | None:
    """The client's X-Request-Id (``headers``' names lower-cased), or None; HttpError(400)
    when it is not acceptable."""
    value = headers.get(HEADER.lower())
    if value is None:
        return None
    value = value.strip()
    if not value or len(value) > MAX_LENGTH or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise HttpError(
            400,
            error_json(
                f"x-request-id: must be 1 to {MAX_LENGTH} printable characters",
                "invalid_request_error",
                "x-request-id",
            ),
        )
    return value
