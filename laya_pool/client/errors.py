"""What the pool refuses or does not answer raises a `PoolError`; each also keeps the type a caller may already catch.
(Input the client refuses before sending raises the SDK's types: `QuestionError`, `SchemaError`, `TypeError`.)

Here, apart from the socket code, so the retry policy and the tests can use them without ZeroMQ.
"""
from __future__ import annotations

from laya_pool.protocol.wire import ProtocolError

from .card import CardError


class PoolError(RuntimeError):
    """Base class of the errors a pool call raises. `pool`: the endpoint of the pool it came from, set by a client of
    several pools (client/pools.py; after every pool failed, theirs, comma-separated)."""

    pool: str | None = None


class RequestFailed(PoolError, ValueError):
    """The pool refused the request for good ("final"): retrying the same request cannot help."""

    def __init__(self, message: str, field: str | None = None, row: int | None = None,
                 worker: str | None = None, reason: str | None = None):
        self.field, self.row, self.worker, self.reason = field, row, worker, reason
        super().__init__(message)


class PoolUnavailable(PoolError):
    """The call got no answer: out of time or attempts, or turned away "retryable" each time.

    Which of these is told by the subclass, and by `reason` (a `protocol.contract.Reason` word: from the pool's
    last reply, or "timeout" / "unreachable", the client's own verdicts), never by the message:
    `PoolBusy` (the queue is full; `retry_after` says when to come back), `PoolNoWorker` (no worker serves the
    model), `PoolUnreachable` (nothing answered at the endpoint), `PoolTimeout` (no answer within the deadline).
    Others (the broker shutting down, workers handing the request back ...) are a plain `PoolUnavailable`."""

    def __init__(self, message: str, last: str | None = None, attempts: int = 0, reason: str | None = None,
                 retry_after: float | None = None):
        self.last, self.attempts, self.reason, self.retry_after = last, attempts, reason, retry_after
        super().__init__(message)


class PoolBusy(PoolUnavailable):
    """The pool's queue is full. `retry_after`: seconds the pool asks callers to wait (its queue over its
    recent drain rate, within bounds); the client already waited it out as long as the deadline allowed."""


class PoolNoWorker(PoolUnavailable):
    """The pool answers, but no worker serves the model (none registered, or all restarting), or the worker the
    call named is not ready."""


class PoolUnreachable(PoolUnavailable):
    """Nothing answered at the endpoint: no pool is listening there, or it refuses this client's handshake
    (the message says which when the connection knows)."""


class PoolTimeout(PoolUnavailable):
    """No answer within the call's deadline (the pool was reachable): the pool is slow or stuck, or the deadline
    ran out while the request waited (reason "expired")."""


class MalformedReply(PoolError, ProtocolError):
    """The pool answered with something that breaks the protocol (or does not fit the request)."""

    def __init__(self, field: str, message: str):
        ProtocolError.__init__(self, field, message)


class BadModelCard(PoolError, CardError):
    """The pool's model card cannot be used to encode requests or decode answers."""
