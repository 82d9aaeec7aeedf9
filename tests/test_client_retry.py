"""The retry policy both clients drive, from tables: events in, steps out, on a fake clock. No sockets."""
from __future__ import annotations

import pytest

from laya_pool.client.errors import PoolBusy, PoolError, PoolNoWorker, PoolTimeout, PoolUnavailable, PoolUnreachable
from laya_pool.client.retry import Action, Attempts, RetryPolicy, Step, reply_error
from laya_pool.protocol import wire
from laya_pool.protocol.contract import Reason

OK, RETRY, FINAL = wire.STATUS_OK, wire.STATUS_RETRYABLE, wire.STATUS_FINAL
S, W, RET, RAISE = Action.SEND, Action.WAIT, Action.RETURN, Action.RAISE


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _attempts(policy: RetryPolicy, rand: float = 1.0) -> tuple[Attempts, Clock]:
    clock = Clock()
    return Attempts(policy, rand=lambda: rand, clock=clock), clock


def _run(policy: RetryPolicy, events: list) -> tuple[list[tuple[Action, float, float]], Attempts]:
    """Feed `events` to one call: ("at", t) moves the clock; "sent" / "down" (sent, not connected); "woke" /
    "woke-down"; "full"; "reconnected"; a status, or (status, error map). Returns every step as (action, wait
    seconds, sleep). Jitter is pinned to its top (rand() -> 1.0): a backoff is exactly `backoff * 2**(n-1)`."""
    a, clock = _attempts(policy)
    steps = [a.start()]
    for ev in events:
        if isinstance(ev, tuple) and ev[0] == "at":
            clock.t = ev[1]
            continue
        if ev in ("sent", "down"):
            steps.append(a.sent(connected=ev == "sent"))
        elif ev in ("woke", "woke-down"):
            steps.append(a.woke(connected=ev == "woke"))
        elif ev == "full":
            steps.append(a.send_failed("queue full"))
        elif ev == "reconnected":
            steps.append(a.reconnected())
        elif isinstance(ev, tuple):
            steps.append(a.replied(ev[0], ev[1]))
        else:
            steps.append(a.replied(ev, {"message": f"said {ev}"}))
    return [(s.action, round(s.seconds, 6), round(s.sleep, 6)) for s in steps], a


P = RetryPolicy(timeout=8.0, retries=3, backoff=0.1, max_backoff=0.3, connect_timeout=3.0)
BUSY = (RETRY, {"message": "the pool is busy", "reason": "busy", "retry_after_ms": 500})
TABLE = [
    ("answered at once: the first attempt waits its share of the deadline", ["sent", OK],
     [(S, 0, 0), (W, 2, 0), (RET, 0, 0)]),
    ("final is an answer too", ["sent", FINAL], [(S, 0, 0), (W, 2, 0), (RET, 0, 0)]),
    ("a status the client does not know is returned, not retried", ["sent", "odd"],
     [(S, 0, 0), (W, 2, 0), (RET, 0, 0)]),
    ("silence re-sends at once; the attempts share what is left", ["sent", ("at", 2), "woke", "sent", OK],
     [(S, 0, 0), (W, 2, 0), (S, 0, 0), (W, 2, 0), (RET, 0, 0)]),
    ("silence to the end raises at the deadline, not after 4 x timeout",
     ["sent", ("at", 2), "woke", "sent", ("at", 4), "woke", "sent", ("at", 6), "woke", "sent", ("at", 8), "woke"],
     [(S, 0, 0), (W, 2, 0), (S, 0, 0), (W, 2, 0), (S, 0, 0), (W, 2, 0), (S, 0, 0), (W, 2, 0), (RAISE, 0, 0)]),
    ("a retryable reply with no hint backs off, doubling", ["sent", RETRY, "sent", RETRY, "sent", OK],
     [(S, 0, 0), (W, 2, 0), (S, 0, 0.1), (W, 8 / 3, 0), (S, 0, 0.2), (W, 8 / 2, 0), (RET, 0, 0)]),
    ("busy waits its retry-after (jitter: up to a quarter more)", ["sent", BUSY, ("at", 0.625), "sent", OK],
     [(S, 0, 0), (W, 2, 0), (S, 0, 0.625), (W, 7.375 / 3, 0), (RET, 0, 0)]),
    ("a retry-after past the deadline raises at once",
     ["sent", (RETRY, {"message": "busy", "reason": "busy", "retry_after_ms": 7000})],
     [(S, 0, 0), (W, 2, 0), (RAISE, 0, 0)]),
    ("expired: the pool spent the budget, so the call ends", ["sent", (RETRY, {"message": "x", "reason": "expired"})],
     [(S, 0, 0), (W, 2, 0), (RAISE, 0, 0)]),
    ("a full send queue backs off and uses an attempt", ["full", "full", "sent", OK],
     [(S, 0, 0), (S, 0, 0.1), (S, 0, 0.2), (W, 8 / 2, 0), (RET, 0, 0)]),
    ("a reconnect re-sends at once and counts", ["sent", ("at", 1), "reconnected", "sent", OK],
     [(S, 0, 0), (W, 2, 0), (S, 0, 0), (W, 7 / 3, 0), (RET, 0, 0)]),
    ("not connected: wakes at connect_timeout and raises: nothing listens",
     ["down", ("at", 2), "woke-down", "down", ("at", 3), "woke-down"],
     [(S, 0, 0), (W, 2, 0), (S, 0, 0), (W, 1, 0), (RAISE, 0, 0)]),
]


@pytest.mark.parametrize("events,want", [(e, w) for _, e, w in TABLE], ids=[t[0] for t in TABLE])
def test_steps(events, want):
    got, _ = _run(P, events)
    assert [(act, pytest.approx(sec), pytest.approx(sl)) for act, sec, sl in got] == want


def test_a_connection_that_comes_up_in_time_waits_on_in_the_same_attempt():
    got, a = _run(RetryPolicy(timeout=60.0, retries=3, connect_timeout=3.0), ["down", ("at", 3), "woke"])
    assert got == [(S, 0, 0), (W, 3, 0), (W, 12, 0)] and a.attempts == 1


def test_a_deadline_shorter_than_connect_timeout_ends_unreachable_at_the_deadline():
    got, a = _run(RetryPolicy(timeout=1.0, retries=0, connect_timeout=3.0), ["down", ("at", 1), "woke-down"])
    assert got == [(S, 0, 0), (W, 1, 0), (RAISE, 0, 0)]
    e = a.error("tcp://127.0.0.1:9")
    assert type(e) is PoolUnreachable and e.reason == Reason.UNREACHABLE
    assert "tcp://127.0.0.1:9: nothing answered at this endpoint within 1.0 s" in str(e)


@pytest.mark.parametrize("events,cls,reason", [
    (["sent", ("at", 8), "woke"], PoolTimeout, Reason.TIMEOUT),
    (["down", ("at", 2), "woke-down", "down", ("at", 3), "woke-down"], PoolUnreachable, Reason.UNREACHABLE),
    (["sent", BUSY, "sent", BUSY, "sent", BUSY, "sent", BUSY], PoolBusy, Reason.BUSY),
    (["sent", (RETRY, {"message": "m", "reason": "no-worker"})], PoolNoWorker, Reason.NO_WORKER),
    (["sent", (RETRY, {"message": "m", "reason": "worker-unavailable"})] * 4, PoolNoWorker, Reason.WORKER_UNAVAILABLE),
    (["sent", (RETRY, {"message": "m", "reason": "expired"})], PoolTimeout, Reason.EXPIRED),
    (["sent", (RETRY, {"message": "m", "reason": "shutdown"})] * 4, PoolUnavailable, Reason.SHUTDOWN),
])
def test_the_error_class_and_reason_say_why(events, cls, reason):
    got, a = _run(P, events)
    assert got[-1][0] is RAISE
    e = a.error("ep")
    assert type(e) is cls and e.reason == reason and isinstance(e, PoolUnavailable) and isinstance(e, PoolError)


def test_busy_carries_the_pools_retry_after_and_the_message_names_attempts():
    _, a = _run(P, ["sent", BUSY, "sent", BUSY, "sent", BUSY, "sent", BUSY])
    e = a.error("tcp://x:1")
    assert e.retry_after == pytest.approx(0.5) and e.attempts == 4 and e.last == "the pool is busy"
    assert "the pool is busy (4 attempts" in str(e) and "retry after 0.50 s" in str(e)


def test_the_budget_ends_short_of_the_deadline_by_a_fifth_at_most_250_ms_the_same_moment_for_every_attempt():
    a, clock = _attempts(RetryPolicy(timeout=10.0))
    assert a.budget_ms() == 9750
    a, clock = _attempts(RetryPolicy(timeout=1.0))
    assert a.budget_ms() == 800
    clock.t = 0.5
    assert a.budget_ms() == 300
    clock.t = 2.0
    assert a.budget_ms() == 0


def test_a_shared_start_gives_several_pool_calls_one_deadline():
    clock = Clock()
    clock.t = 7.0
    a = Attempts(RetryPolicy(timeout=10.0, retries=0), started=4.0, clock=clock)
    assert a.start() == Step(S) and a.sent().seconds == pytest.approx(7.0)


def test_backoff_is_capped_and_jittered_between_half_and_all():
    p = RetryPolicy(backoff=0.05, max_backoff=1.0)
    assert [p.pause(n, lambda: 1.0) for n in (1, 2, 3, 6, 10)] == pytest.approx([0.05, 0.1, 0.2, 1.0, 1.0])
    assert p.pause(3, lambda: 0.0) == pytest.approx(0.1)


def test_policy_refuses_nonsense():
    for bad in ({"timeout": 0}, {"retries": -1}, {"connect_timeout": 0}):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)


@pytest.mark.parametrize("header,want", [({"error": {"message": "busy!"}}, {"message": "busy!"}),
                                         ({"error": "garbage"}, None), ({}, None)])
def test_reply_error(header, want):
    assert reply_error(header) == want


def test_a_clients_policy_follows_its_settings():
    """The client keeps the last call's policy while its settings stay (a frozen dataclass a call cost 1.5 us to
    build); a changed setting, or a call's own timeout or retries, gets a policy of its own."""
    from laya_pool.client.pool import Client

    c = Client("tcp://127.0.0.1:1", timeout=7.0, retries=2)     # (nothing listens: no call is made)
    try:
        first = c._attempts(None, None, None).policy
        assert (first.timeout, first.retries) == (7.0, 2)
        assert c._attempts(None, None, None).policy is first
        assert c._attempts(1.5, None, None).policy.timeout == 1.5
        assert c._attempts(None, 0, None).policy.retries == 0
        c.timeout, c.backoff = 3.0, 0.2
        changed = c._attempts(None, None, None).policy
        assert (changed.timeout, changed.retries, changed.backoff) == (3.0, 2, 0.2)
    finally:
        c.close()
