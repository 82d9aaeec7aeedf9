"""The retry policy both clients drive, from tables: events in, steps out. No sockets."""
from __future__ import annotations

import pytest

from client.errors import PoolError, PoolUnavailable
from client.retry import Action, Attempts, RetryPolicy, Step, reply_message
from protocol import wire

OK, RETRY, FINAL = wire.STATUS_OK, wire.STATUS_RETRYABLE, wire.STATUS_FINAL
S, W, RET, RAISE = Action.SEND, Action.WAIT, Action.RETURN, Action.RAISE


def _run(policy: RetryPolicy, events: list) -> list[tuple[Action, float]]:
    """Feed `events` ("sent", "full", "timeout" or a reply status) to one call; the steps, as (action, sleep).
    Jitter is pinned to its top (rand() -> 1.0), so a backoff is exactly `backoff * 2**(attempt-1)`, capped."""
    a = Attempts(policy, rand=lambda: 1.0)
    steps = [a.start()]
    for ev in events:
        if ev == "sent":
            steps.append(a.sent())
        elif ev == "full":
            steps.append(a.send_failed("queue full"))
        elif ev == "timeout":
            steps.append(a.timed_out())
        else:
            steps.append(a.replied(ev, f"said {ev}"))
    return [(s.action, s.sleep) for s in steps]


P = RetryPolicy(timeout=2.0, retries=2, backoff=0.1, max_backoff=0.3)
TABLE = [
    ("answered at once", ["sent", OK], [(S, 0), (W, 0), (RET, 0)]),
    ("final is an answer too", ["sent", FINAL], [(S, 0), (W, 0), (RET, 0)]),
    ("a status the client does not know is returned, not retried", ["sent", "odd"], [(S, 0), (W, 0), (RET, 0)]),
    ("timeout retries at once", ["sent", "timeout", "sent", OK], [(S, 0), (W, 0), (S, 0), (W, 0), (RET, 0)]),
    ("retryable backs off, doubling", ["sent", RETRY, "sent", RETRY, "sent", OK],
     [(S, 0), (W, 0), (S, 0.1), (W, 0), (S, 0.2), (W, 0), (RET, 0)]),
    ("three timeouts with retries=2 raise", ["sent", "timeout", "sent", "timeout", "sent", "timeout"],
     [(S, 0), (W, 0), (S, 0), (W, 0), (S, 0), (W, 0), (RAISE, 0)]),
    ("no backoff after the last retryable", ["sent", RETRY, "sent", RETRY, "sent", RETRY],
     [(S, 0), (W, 0), (S, 0.1), (W, 0), (S, 0.2), (W, 0), (RAISE, 0)]),
    ("a full send queue backs off and uses an attempt", ["full", "full", "sent", OK],
     [(S, 0), (S, 0.1), (S, 0.2), (W, 0), (RET, 0)]),
    ("a full queue on the last attempt still backs off, then raises", ["full", "full", "full"],
     [(S, 0), (S, 0.1), (S, 0.2), (RAISE, 0.3)]),
]


@pytest.mark.parametrize("events,want", [(e, w) for _, e, w in TABLE], ids=[t[0] for t in TABLE])
def test_steps(events, want):
    got = _run(P, events)
    assert [(act, pytest.approx(sleep)) for act, sleep in got] == want


def test_backoff_is_capped_and_jittered_between_half_and_all():
    p = RetryPolicy(backoff=0.05, max_backoff=1.0)
    assert [p.pause(n, lambda: 1.0) for n in (1, 2, 3, 6, 10)] == pytest.approx([0.05, 0.1, 0.2, 1.0, 1.0])
    assert p.pause(3, lambda: 0.0) == pytest.approx(0.1)


def test_wait_uses_the_policy_timeout_and_retries_zero_means_one_attempt():
    a = Attempts(RetryPolicy(timeout=0.7, retries=0))
    assert a.start() == Step(S) and a.sent() == Step(W, seconds=0.7)
    assert a.timed_out().action is RAISE and a.attempts == 1


def test_the_error_names_the_attempts_and_the_last_failure():
    a = Attempts(RetryPolicy(timeout=1.0, retries=1), rand=lambda: 0.5)
    a.start(), a.sent(), a.timed_out(), a.sent()
    assert a.replied(RETRY, "the pool is busy").action is RAISE
    e = a.error("tcp://x:1")
    assert isinstance(e, PoolUnavailable) and isinstance(e, PoolError)
    assert e.attempts == 2 and e.last == "the pool is busy" and "2 attempts (the pool is busy)" in str(e)


@pytest.mark.parametrize("header,want", [({"error": {"message": "busy!"}}, "busy!"),
                                         ({"error": "garbage"}, "retryable"), ({}, "retryable"),
                                         ({"error": {}}, "retryable")])
def test_reply_message(header, want):
    assert reply_message(header) == want
