"""The client's retry loop (Lazy Pirate under one deadline) as a policy with no I/O in it.

Both `Client` (blocking) and `AsyncClient` (asyncio) drive the same `Attempts`: they tell it what
happened ("sent", "the send queue was full", "the wait ended with no reply", "replied with this
status") and whether the socket is connected, and it answers what to do next (send, wait, return the
reply, or raise), with how long to sleep or wait. The two drivers only move bytes, so the loops cannot
drift apart, and the rules are tested from a table with a fake clock (tests/test_client_retry.py).

The rules:
- one deadline: the call answers or raises within `timeout` seconds of its start, whatever happens;
- every attempt sends the same request (same request id) with the time left (`budget_ms`, a little short of
  the deadline, so that the pool's "expired" / "no-worker" verdict can still reach us); the deadline is split
  over the attempts left, and an attempt that hears nothing in its share is sent again at once (the broker
  joins a retry to the request still running, so this costs nothing);
- a "retryable" reply is retried after its retry-after hint ("busy") or an exponential backoff with jitter,
  unless that wait would pass the deadline: then the call raises at once, with the hint;
- no connection to the pool for `connect_timeout` seconds raises `PoolUnreachable` (nothing listens there);
- any other reply is returned; after `retries` re-sends the call raises, naming what went wrong last.
"""
from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from laya_pool.protocol import contract, wire
from laya_pool.protocol.contract import Reason

from .errors import PoolBusy, PoolNoWorker, PoolTimeout, PoolUnavailable, PoolUnreachable

MARGIN_S = 0.25          # the budget a request carries ends this much (at most) before the call's deadline ...
MARGIN_SHARE = 0.2       # ... and at most this share of the call's timeout


class Action(enum.Enum):
    SEND = "send"        # send the request (again)
    WAIT = "wait"        # wait up to `Step.seconds` for its reply, then call `woke` (or `replied`)
    RETURN = "return"    # the reply is the answer: hand it to the caller
    RAISE = "raise"      # raise `Attempts.error()`


@dataclass(frozen=True)
class Step:
    action: Action
    seconds: float = 0.0     # WAIT: how long
    sleep: float = 0.0       # sleep this long before acting (a backoff, a retry-after)


_RETURN = Step(Action.RETURN)    # (every answered call ends so: one frozen Step shared, not one built a call)


@dataclass(frozen=True)
class RetryPolicy:
    timeout: float = contract.CALL_TIMEOUT_S            # the call's deadline, seconds from its start
    retries: int = 3                                    # re-sends after the first attempt, within the deadline
    backoff: float = 0.05                               # first backoff, doubled per attempt ...
    max_backoff: float = 1.0                            # ... up to this
    connect_timeout: float = contract.CONNECT_TIMEOUT_S  # no connection this long: the pool is unreachable

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.retries < 0 or self.connect_timeout <= 0:
            raise ValueError("timeout and connect_timeout must be positive and retries non-negative")

    def pause(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """The backoff after attempt number `attempt` (1-based): exponential, capped, with 50-100% jitter."""
        return min(self.max_backoff, self.backoff * (2 ** (attempt - 1))) * (0.5 + rand() / 2)


class _Why(enum.Enum):
    """What went wrong last: it picks the error's class."""
    SILENCE = "silence"          # no reply (reachable): PoolTimeout
    UNREACHABLE = "unreachable"  # no connection: PoolUnreachable
    REPLY = "reply"              # a retryable reply: its reason picks the class
    OTHER = "other"


_BY_REASON: dict[str, type[PoolUnavailable]] = {
    Reason.BUSY: PoolBusy, Reason.NO_WORKER: PoolNoWorker, Reason.WORKER_UNAVAILABLE: PoolNoWorker,
    Reason.EXPIRED: PoolTimeout, Reason.QUEUE_TIMEOUT: PoolTimeout}

# Retryable replies that mean the pool has already spent the call's budget: retrying cannot help in time.
_SPENT = (Reason.EXPIRED, Reason.NO_WORKER)


class Attempts:
    """One call's attempts: feed it events, do what it answers. `started`: when the call began (a call of
    several pool calls, predict's describe and forward, shares one deadline); `clock`: time.monotonic."""

    def __init__(self, policy: RetryPolicy, rand: Callable[[], float] = random.random, *,
                 started: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.policy, self.rand, self.clock = policy, rand, clock
        self.started = clock() if started is None else started
        self.deadline = self.started + policy.timeout
        self.up_at = self.started       # the connection was last seen up then (or the call started)
        self.attempts = 0               # attempts started so far
        self.attempt_end = self.started
        self.last = "no reply"          # what went wrong last, for the error message
        self.why = _Why.SILENCE
        self.reason: str | None = None
        self.retry_after: float | None = None

    @property
    def silent(self) -> bool:
        """The last attempt ended with no reply while connected (not a refusal, not a dropped connection)."""
        return self.why is _Why.SILENCE and self.last == "no reply"

    # -- events ---------------------------------------------------------------------------------------------
    def start(self) -> Step:
        return self._next_attempt()

    def budget_ms(self) -> int:
        """The time the pool may spend on the request now: until a moment before the call's deadline, the same
        moment for every attempt (a retry renews the broker's deadline for it, never pushes it later)."""
        margin = min(MARGIN_S, MARGIN_SHARE * self.policy.timeout)
        return max(0, int((self.deadline - margin - self.clock()) * 1e3))

    def sent(self, connected: bool = True) -> Step:
        """The attempt went out: wait for its share of the time left (the last attempt: all of it)."""
        now = self._now(connected)
        share = (self.deadline - now) / (self.policy.retries + 2 - self.attempts)
        self.attempt_end = now + share
        return self._wait(now, connected)

    def send_failed(self, why: str, connected: bool = True) -> Step:
        """The socket refused the message (no connection, or its queue is full): back off, then try again."""
        self._now(connected)
        self.last, self.why = why, (_Why.OTHER if connected else _Why.UNREACHABLE)
        if self._unreachable(connected):
            return Step(Action.RAISE)
        return self._next_attempt(sleep=self.policy.pause(self.attempts, self.rand))

    def woke(self, connected: bool = True, trouble: str | None = None) -> Step:
        """A wait ended with no reply. `trouble`: what the connection knows (the pool refuses our handshake)."""
        now = self._now(connected)
        if not connected:
            self.last, self.why = trouble or "no connection", _Why.UNREACHABLE
            if self._unreachable(connected):
                return Step(Action.RAISE)
        if now >= self.deadline:
            if connected:
                self.last, self.why = "no reply", _Why.SILENCE
            return Step(Action.RAISE)
        if now >= self.attempt_end:
            if connected:
                self.last, self.why = "no reply", _Why.SILENCE
            return self._next_attempt()
        return self._wait(now, connected)      # woken early (to look at the connection): wait on

    def reconnected(self) -> Step:
        """The connection dropped and came back (a new broker): the request died with the old one; send it
        again now (same request id) instead of waiting out the attempt. Counts as an attempt."""
        self._now(True)
        self.last, self.why = "the connection to the pool was lost", _Why.OTHER
        return self._next_attempt()

    def replied(self, status: object, error: dict | None = None) -> Step:
        """A reply: returned unless "retryable"; that is retried after its retry-after (or a backoff) if the
        deadline and the attempts allow, and raised otherwise."""
        if status != wire.STATUS_RETRYABLE:
            return _RETURN
        now = self._now(True)
        err = error if isinstance(error, dict) else {}
        message = err.get("message")
        self.last = message if isinstance(message, str) and message else "retryable"
        reason = err.get("reason")
        self.why, self.reason = _Why.REPLY, (reason if isinstance(reason, str) else None)
        self.retry_after = wire.retry_after_of(err)
        if self.reason in _SPENT:
            return Step(Action.RAISE)
        if self.retry_after is not None:
            wait = self.retry_after * (1 + self.rand() / 4)    # spread the callers told the same hint
        else:
            wait = self.policy.pause(self.attempts, self.rand)
        if now + wait >= self.deadline:
            return Step(Action.RAISE)
        return self._next_attempt(sleep=wait)

    # -- the verdict ----------------------------------------------------------------------------------------
    def error(self, endpoint: str) -> PoolUnavailable:
        """The typed error for what went wrong last."""
        n, elapsed = self.attempts, self.clock() - self.started
        if self.why is _Why.UNREACHABLE:
            why = self.last if self.last != "no connection" else "no connection: is a pool running and listening there?"
            return PoolUnreachable(f"{endpoint}: nothing answered at this endpoint within {elapsed:.1f} s ({why})",
                                   last=self.last, attempts=n, reason=Reason.UNREACHABLE)
        if self.why is _Why.SILENCE:
            return PoolTimeout(f"{endpoint}: no answer within the call's deadline of {self.policy.timeout:g} s "
                               f"({n} attempts)", last=self.last, attempts=n, reason=Reason.TIMEOUT)
        if self.why is _Why.REPLY:
            cls = _BY_REASON.get(self.reason or "", PoolUnavailable)
            hint = f"; retry after {self.retry_after:.2f} s" if self.retry_after is not None else ""
            return cls(f"{endpoint}: {self.last} ({n} attempts in {elapsed:.1f} s{hint})", last=self.last,
                       attempts=n, reason=self.reason, retry_after=self.retry_after)
        return PoolUnavailable(f"{endpoint}: no answer after {n} attempts in {elapsed:.1f} s ({self.last})",
                               last=self.last, attempts=n)

    # -- inside ---------------------------------------------------------------------------------------------
    def _now(self, connected: bool) -> float:
        now = self.clock()
        if connected:
            self.up_at = now
        return now

    def _unreachable(self, connected: bool) -> bool:
        """No connection for `connect_timeout` (or until the deadline)."""
        now = self.clock()
        return not connected and (now - self.up_at >= self.policy.connect_timeout or now >= self.deadline)

    def _wait(self, now: float, connected: bool) -> Step:
        until = min(self.attempt_end, self.deadline)
        if not connected:      # wake up to see whether it came up in time
            until = min(until, self.up_at + self.policy.connect_timeout)
        return Step(Action.WAIT, seconds=max(0.0, until - now))

    def _next_attempt(self, sleep: float = 0.0) -> Step:
        if self.attempts > self.policy.retries or self.clock() + sleep >= self.deadline:
            return Step(Action.RAISE)
        self.attempts += 1
        return Step(Action.SEND, sleep=sleep)


def reply_error(header: dict) -> dict | None:
    """The `error` map of a reply header, for `Attempts.replied`."""
    err = header.get("error")
    return err if isinstance(err, dict) else None
