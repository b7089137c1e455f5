"""The router's refusals: ``RouterError(code, message)``, one code per way a call can fail.

- The gRPC servicers end the RPC with the status of the same name (server.py).
- The OpenAI HTTP layer answers with an HTTP status (openai_api.py).
- ``message`` starts with the field it names (``"prompt.text: empty"``) whenever one is at
  fault, so both layers can point at it.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Named as the gRPC status each one becomes."""

    INVALID_ARGUMENT = "invalid_argument"  # a request field is wrong; nothing ran
    ALREADY_EXISTS = "already_exists"  # a request (or a live worker) with this id is running
    PERMISSION_DENIED = "permission_denied"  # the caller's credential may not act on this id
    UNAVAILABLE = "unavailable"  # a worker died under a request that had streamed tokens


class RouterError(Exception):
    """A call the router refused or could not finish; ``message`` says why."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
