"""The client's retry loop (Lazy Pirate) as a policy with no I/O in it.

Both `Client` (blocking) and `AsyncClient` (asyncio) drive the same `Attempts`: they tell it what
happened ("sent", "the send queue was full", "timed out", "replied with this status") and it answers
what to do next (send, wait, return the reply, or raise), with how long to sleep first. The two
drivers only move bytes, so the loops cannot drift apart again, and the rules are tested from a table
without a socket (tests/test_client_retry.py).

The rules: every attempt sends the same request (same request id); a timeout is retried at once (the
wait was the pause); a "retryable" reply or a full send queue is retried after an exponential backoff
with jitter; any other reply is returned; after `retries + 1` attempts the call raises
`PoolUnavailable` naming the last thing that went wrong.
"""
from __future__ import annotations

import enum
import random
from collections.abc import Callable
from dataclasses import dataclass

from client.errors import PoolUnavailable
from protocol import wire


class Action(enum.Enum):
    SEND = "send"        # send the request (again)
    WAIT = "wait"        # wait up to `Step.seconds` for its reply
    RETURN = "return"    # the reply is the answer: hand it to the caller
    RAISE = "raise"      # out of attempts: raise `Attempts.error()`


@dataclass(frozen=True)
class Step:
    action: Action
    seconds: float = 0.0     # WAIT: the reply timeout
    sleep: float = 0.0       # sleep this long before acting (a backoff)


@dataclass(frozen=True)
class RetryPolicy:
    timeout: float = 10.0        # seconds one attempt waits for its reply
    retries: int = 3             # attempts after the first
    backoff: float = 0.05        # first backoff, doubled per attempt ...
    max_backoff: float = 1.0     # ... up to this

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.retries < 0:
            raise ValueError("timeout must be positive and retries non-negative")

    def pause(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """The backoff after attempt number `attempt` (1-based): exponential, capped, with 50-100% jitter."""
        return min(self.max_backoff, self.backoff * (2 ** (attempt - 1))) * (0.5 + rand() / 2)


class Attempts:
    """One call's attempts: feed it events, do what it answers."""

    def __init__(self, policy: RetryPolicy, rand: Callable[[], float] = random.random):
        self.policy, self.rand = policy, rand
        self.attempts = 0              # attempts started so far
        self.last = "no reply"         # what went wrong last, for the error message

    def start(self) -> Step:
        return self._next_attempt()

    def sent(self) -> Step:
        return Step(Action.WAIT, seconds=self.policy.timeout)

    def send_failed(self, why: str) -> Step:
        """The socket refused the message (its queue is full): back off, then try the next attempt."""
        self.last = why
        return self._next_attempt(sleep=self.policy.pause(self.attempts, self.rand))

    def timed_out(self, trouble: str | None = None) -> Step:
        """`trouble`: what the connection knows (the pool refuses our handshake), for the error message."""
        self.last = f"no reply within {self.policy.timeout:g} s" + (f": {trouble}" if trouble else "")
        return self._next_attempt()

    def reconnected(self) -> Step:
        """The connection dropped and came back (a new broker): the request died with the old one; send it
        again now (same request id) instead of waiting out the timeout. Counts as an attempt."""
        self.last = "the connection to the pool was lost"
        return self._next_attempt()

    def replied(self, status: object, message: str = "retryable") -> Step:
        if status != wire.STATUS_RETRYABLE:
            return Step(Action.RETURN)
        self.last = message
        sleep = self.policy.pause(self.attempts, self.rand) if self.attempts <= self.policy.retries else 0.0
        return self._next_attempt(sleep=sleep)

    def error(self, endpoint: str) -> PoolUnavailable:
        n = self.policy.retries + 1
        return PoolUnavailable(f"{endpoint}: no answer after {n} attempts ({self.last})", last=self.last, attempts=n)

    def _next_attempt(self, sleep: float = 0.0) -> Step:
        if self.attempts > self.policy.retries:
            return Step(Action.RAISE, sleep=sleep)
        self.attempts += 1
        return Step(Action.SEND, sleep=sleep)


def reply_message(header: dict) -> str:
    """The `error.message` of a retryable reply header, for `Attempts.replied`."""
    err = header.get("error")
    return err.get("message", "retryable") if isinstance(err, dict) else "retryable"
