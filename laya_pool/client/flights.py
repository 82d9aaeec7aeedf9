"""Several plans' pool calls on the wire together over one blocking `Client` (a predict_batch larger than one
request; client/plans.py `Many`).

Each plan runs until it asks for a pool call; up to `limit` calls are out at once over the client's one socket, and
every call's attempts advance on their own (client/retry.py) as its reply, its timeout or the connection's events
come. The first failure is raised; replies still owed to the other calls are dropped as stale when they come.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from laya_pool.protocol import wire

from .errors import PoolError
from .plans import Call, Plan
from .retry import Action, Attempts, Step, reply_error


@dataclass
class Flight:
    """One of the plans while its pool call is out."""
    index: int                  # the plan's place in the results
    plan: Generator[Any, Any, Any]
    started: float              # when the plan began: its calls share one deadline
    frames: list[Any]
    attempts: Attempts
    on_sent: Callable[[], None] | None
    direct: bool = False
    step: Step = Step(Action.WAIT)
    due: float = 0.0            # when `step` is due: a wait's end (then `woke`) or a backoff's (then `step`)
    backing_off: bool = False


class Flights:
    """The calls of `plans` over `client` (a `Client`, whose lock the caller holds), results in order."""

    def __init__(self, client: Any, plans: list[Plan[Any]], limit: int, started: float | None = None):
        """`started`: when the call these plans are part of began: the plans that go out at once share its deadline
        (the states' tokenizing included); each one queued behind them has its own from when it goes out, so a batch
        of thousands of states does not time out behind itself. None: each plan's own start."""
        self.client, self.limit, self.started = client, limit, started
        self.results: list[Any] = [None] * len(plans)
        self.queued = list(enumerate(plans))[::-1]
        self.flights: dict[int, Flight] = {}      # by request id

    def run(self) -> list[Any]:
        first = self.started          # for the plans that go out at once
        while self.queued or self.flights:
            while self.queued and len(self.flights) < self.limit:
                i, plan = self.queued.pop()
                self._advance(i, plan, time.monotonic() if first is None else first, None)
            first = None
            if self.flights:
                self._progress()
        return self.results

    def _advance(self, i: int, plan: Plan[Any], started: float, answer: Any) -> None:
        """Run plan `i` (sending it `answer`; None: start it) until it asks for a pool call, which goes out, or ends."""
        c = self.client
        try:
            step = next(plan) if answer is None else plan.send(answer)
            while not isinstance(step, Call):
                step = plan.send(c._answer(step, started))
        except StopIteration as done:
            self.results[i] = done.value
            return
        if step.direct and not self.flights:
            # Not with calls out: the question's own wait would drop their replies as stale (asked again later).
            c._ask_routes()
        rid = next(c._rids)
        f = Flight(i, plan, started, step.build(rid, c.cid), c._attempts(step.timeout, step.retries, started),
                   step.on_sent, step.direct)
        self.flights[rid] = f
        self._drive(rid, f, f.attempts.start())

    def _drive(self, rid: int, f: Flight, step: Step, msg: wire.Message | None = None) -> None:
        """Carry out `step` for call `rid` until it must wait for something: a reply, its timeout or a backoff."""
        c = self.client
        while True:
            if step.sleep:
                f.step, f.due, f.backing_off = Step(step.action, step.seconds), time.monotonic() + step.sleep, True
                return
            if step.action is Action.SEND:
                if c._sock is None:
                    raise PoolError("the client is closed")
                step = c._send(f.frames, f.attempts, rid if f.direct else None)
                if f.on_sent is not None:
                    f.on_sent, on_sent = None, f.on_sent
                    on_sent()
            elif step.action is Action.WAIT:
                f.step, f.due, f.backing_off = step, time.monotonic() + step.seconds, False
                return
            elif step.action is Action.RETURN:
                del self.flights[rid]
                self._advance(f.index, f.plan, f.started, (msg, f.attempts.attempts))
                return
            else:
                del self.flights[rid]
                c._forget(rid)
                raise f.attempts.error(c.endpoint)

    def _progress(self) -> None:
        """Take what has come (replies, connection events), then act for calls whose wait or backoff is over, then
        wait for the first of: a reply, an event, the next call's timeout or backoff. Replies are read before any
        timeout is judged, so work between two polls never turns an answered call into a timed-out one."""
        flights, watch = self.flights, self.client._watch
        self._take(0)
        for rid, f in list(flights.items()):
            if rid in flights and f.due <= time.monotonic():
                step = f.step if f.backing_off else f.attempts.woke(watch.up, watch.trouble)
                self._drive(rid, f, step)
        if flights:
            self._take(max(1, int((min(f.due for f in flights.values()) - time.monotonic()) * 1000) + 1))

    def _take(self, wait_ms: int) -> None:
        """Poll up to `wait_ms`; hand every reply that came to its call, and a new broker to every waiting call."""
        c, flights = self.client, self.flights
        if c._sock is None:
            raise PoolError("the client is closed")
        ready = c._receiver.poll(wait_ms, sole=len(flights) == 1)
        if ready.get(c._mon) and c._events():     # a new broker: what was sent died with the old one
            for rid, f in list(flights.items()):
                if rid in flights and not f.backing_off:
                    self._drive(rid, f, f.attempts.reconnected())
        # Replies before dropped connections: a worker that answered and then left must not cost its answer.
        for msg in c._receiver.replies(ready):
            rid = msg.header.get("rid")
            f = flights.get(rid) if isinstance(rid, int) else None
            if f is None:
                continue    # a stale reply to an earlier attempt or an abandoned call
            status = msg.header.get("status")
            if f.backing_off and status not in (wire.STATUS_OK, wire.STATUS_FINAL):
                continue    # an earlier attempt's retryable answer: the backoff already stands for it
            self._drive(rid, f, f.attempts.replied(status, reply_error(msg.header)), msg)
        for rid in c._receiver.dropped(ready):         # a worker's direct connection dropped with them on it
            f = flights.get(rid)
            if f is not None and not f.backing_off:
                self._drive(rid, f, f.attempts.reconnected())
