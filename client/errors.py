"""Every error a pool call raises is a `PoolError`; each also keeps the type a caller may already catch.

Here, apart from the socket code, so the retry policy and the tests can use them without ZeroMQ.
"""
from __future__ import annotations

from client.card import CardError
from protocol.wire import ProtocolError


class PoolError(RuntimeError):
    """Base class of the errors a pool call raises."""


class RequestFailed(PoolError, ValueError):
    """The pool refused the request for good ("final"): retrying the same request cannot help."""

    def __init__(self, message: str, field: str | None = None, row: int | None = None,
                 worker: str | None = None, reason: str | None = None):
        self.field, self.row, self.worker, self.reason = field, row, worker, reason
        super().__init__(message)


class PoolUnavailable(PoolError):
    """Every attempt timed out or was answered "retryable" (busy, worker lost, no worker)."""

    def __init__(self, message: str, last: str | None = None, attempts: int = 0):
        self.last, self.attempts = last, attempts
        super().__init__(message)


class MalformedReply(PoolError, ProtocolError):
    """The pool answered with something that breaks the protocol (or does not fit the request)."""

    def __init__(self, field: str, message: str):
        ProtocolError.__init__(self, field, message)


class BadModelCard(PoolError, CardError):
    """The pool's model card cannot be used to encode requests or decode answers."""
