"""How a transfer fails, whatever the backend moving it: every error a transport, a page
group or an agent raises is a :class:`TransferError`."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A message could not be moved."""


class TransferTimeout(TransferError, TimeoutError):
    """A message did not complete before its deadline."""


class TransportClosed(TransferError):
    """The transport is closed (or was never started)."""
