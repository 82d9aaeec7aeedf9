"""The worker's compute thread: admit each queued request, take a group, run it, answer every member.

Words: a *request* is what the broker sent (`wire.Request`, queued here as `Queued`); a *batch* is rows
the runtime runs in one forward (`worker.batch.Batch`: one request's rows, or a group's merged); a
*group* is the requests that share one forward (`worker.merge.Group`, dynamic batching).

This module is the thread's loop and what it waits for; which requests share a forward is worker/grouping.py's,
launching a group and answering its members worker/running.py's (mixins of `Compute`: one thread's state, and no
indirection on the data thread's path).

The thread owns the runtime. It takes its work from an inbox (worker/inbox.py): in a worker its own data socket
to the broker, polled together with the launched group's event, so it is the worker's *data thread*; in tests a
queue. It sends every encoded reply through `reply` (in a worker, on the same data socket). Every request message
it takes through `intake` gets exactly one reply, which `outstanding` counts for the I/O thread's drain. It keeps
up to `runtime.depth` groups launched (two on CUDA): while group N
computes, it admits, merges and launches group N+1 (which queues behind N on the device), then waits
for N and answers it, so the device never waits for the host's validation and packing. With nothing
launched and nothing queued it lets the runtime capture a bucket a request missed (`idle_work`).
Every request gets exactly one reply:

- refused by validation (`RequestError`): "final", naming field and row; the worker keeps serving;
- queued before the worker registered again: "retryable" (stale), its client retries through the new registration;
- its caller's deadline passed before compute started: "retryable" (expired), skipped unrun (the broker drops
  it: the caller has given up); a request already computing finishes;
- a failed upload (drained before raising): "retryable" (upload-failed); the worker keeps serving;
- a merged group whose run fails: its members run alone, so the failure finds its owner;
- anything else on CUDA: "retryable" (worker-fault) and the worker is fatal (the context may be poisoned).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from laya_pool.protocol import settings, wire
from laya_pool.protocol.contract import Reason
from laya_pool.protocol.histogram import SECONDS_BOUNDS, Histogram

from .grouping import DONE, Grouping, Queued
from .inbox import NOTHING, QueueInbox
from .landing import Landed
from .merge import Group
from .running import Flight, Running

log = logging.getLogger("laya-pool.worker")

_IDLE = object()    # what `_next` returns after an idle-time capture (besides a request, DONE and NOTHING)
# Nothing launched and nothing arriving for this long: idle enough to capture a missed bucket (a request that
# arrives during the capture waits for it, tens of ms, once per bucket; a short gap in steady traffic does not count).
IDLE_S = 0.005
# Padding tokens a group's forward may hold beyond what its members pad to alone (--merge-waste); a request that would
# take it past waits for another group. About what a forward's fixed cost buys (1x48 replays in ~1 ms; a token costs
# 1.3-1.9 us on an H100), so past it a second forward is cheaper than more padding: a mixed load ran 1.5-1.7x
# faster with the bound (docs/decisions/0013-merge-waste-bound.md).
MERGE_WASTE = 512


@dataclass(frozen=True)
class FaultHooks:
    """Test hooks for faults no CPU can cause, read from the environment by `main` and handed in here.

    hang_rows: block (as a hung device would) on any request of that many rows; the I/O thread keeps
    heartbeating. fault_rows: raise inside the run of any group holding a request of that many rows (what
    a device fault or a runtime bug looks like from here). 0: off."""
    hang_rows: int = 0
    fault_rows: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FaultHooks:
        return cls(hang_rows=settings.get("LAYA_WORKER_HANG_ROWS", env),
                   fault_rows=settings.get("LAYA_WORKER_FAULT_ROWS", env))


class Compute(Grouping, Running):
    def __init__(self, runtime: Any, worker_id: str, fingerprint: str, max_group: int,
                 reply: Callable[[list[Any], bytes | None], None], counts: dict[str, int],
                 faults: FaultHooks = FaultHooks(), inbox: Any = None, merge_waste: int | None = MERGE_WASTE):
        self.rt, self.id, self.fingerprint = runtime, worker_id, fingerprint
        self.max_group = max_group        # requests merged into one forward (--max-batch)
        self.merge_waste = merge_waste    # padding tokens a group may hold (--merge-waste; None: any)
        self.row_step = getattr(runtime, "row_len_step", 1)
        self._send, self.counts, self.faults = reply, counts, faults
        # Gives Queued requests, Landed groups (a launched group's answers are in) and None: stop once what is
        # before it is done. Default: a queue others fill, with a landing-watch thread.
        self.inbox = inbox if inbox is not None else QueueInbox(name=f"landing-{worker_id}")
        self.inbox.intake = self.intake
        self.inbox.oldest = lambda: self.flights[0] if self.flights else None
        self.session = 0                  # the I/O thread's registration; older requests are stale
        self.stopping = False             # set by the I/O thread when it drains: refuse new requests
        self.closing = False              # set once the last groups are answered: refuse every request
        self.taken = self.answered = 0    # request messages taken by `intake`; replies sent (this thread's alone)
        self.fatal: str | None = None     # set when the device may be broken; the I/O thread then leaves
        self.runtime_stats: dict[str, Any] = {}
        # Arrival -> ok answer of every request, whichever way it came: the broker's meter sees only what it routed.
        self.answer_seconds = Histogram(SECONDS_BOUNDS)
        self.last_stats = 0.0
        self._busy_since: float | None = None  # `busy_since`
        self._busy: tuple[float, float | None] = (0.0, None)    # (seconds busy before now's stretch, its start)
        self.flights: deque[Flight] = deque()   # launched, not yet answered, oldest first
        self.waiting: deque[Queued] = deque()   # taken, set aside by a group (`take_group`), oldest first
        if hasattr(runtime, "before_capture"):
            runtime.before_capture = self.inbox.quiesce

    @property
    def busy_since(self) -> float | None:
        """When the oldest unanswered group was taken (None: nothing is): the I/O thread's watchdog reads it."""
        return self._busy_since

    @busy_since.setter
    def busy_since(self, when: float | None) -> None:
        # The worker's busy time (`busy_seconds`) runs from the moment work is taken until none is unanswered.
        total, start = self._busy
        if when is not None and start is None:
            self._busy = (total, time.monotonic())
        elif when is None and start is not None:
            self._busy = (total + time.monotonic() - start, None)
        self._busy_since = when

    def busy_seconds(self) -> float:
        """Seconds this worker had work taken and not answered: its device's busy time, with the host's part of each
        group (read by the I/O thread, for the stats: one tuple read whole, so the total never goes back)."""
        total, start = self._busy
        return total + (time.monotonic() - start if start is not None else 0.0)

    def outstanding(self) -> int:
        """Request messages taken and not yet answered (read by the I/O thread: `answered` first, so a count read
        between the two increments errs high, never low)."""
        answered = self.answered
        return self.taken - answered

    def reply(self, frames: list[Any], to: Any = None, answers: int = 1) -> None:
        """Send one reply (`answers`: the requests it answers, more than one for a BUNDLE): to the broker, or (`to`)
        to the client that sent the request here itself."""
        self.answered += answers
        self._send(frames, to)

    def intake(self, msg: wire.Message, received: float, to: Any = None) -> Queued | None:
        """A REQUEST message, received at `received` (from the broker, or from the client `to` on the direct
        socket): the request to run, or None when it was answered here (the worker is stopping, or the message is
        not a well-formed request). Either way it gets one reply."""
        self.taken += 1
        rid = msg.header.get("rid")
        # A request addressed to this worker is run while it drains: handed back, it could only wait in the broker
        # for this worker's return (or its caller's deadline).
        if self.closing or (self.stopping and msg.header.get("worker") != self.id):
            self.counts["handed_back"] += 1
            self.reply(wire.encode_error(rid, wire.STATUS_RETRYABLE, f"worker {self.id} is stopping",
                                         worker=self.id, reason=Reason.STOPPING), to)
            return None
        try:
            req = wire.parse_request(msg, need_cid=to is not None)
        except wire.ProtocolError as e:
            self.counts["protocol_errors"] += 1
            self.reply(wire.encode_error(rid if isinstance(rid, (int, str)) else None, wire.STATUS_FINAL, str(e),
                                         field=e.field, worker=self.id), to)
            return None
        self.counts["received"] += 1
        return Queued.of(self.session, req, received, to)

    def loop(self) -> None:
        """The thread's body: until the stop sentinel, or until the worker is fatal."""
        stop = False
        while self.fatal is None and not (stop and not self.waiting):
            if len(self.flights) >= self.rt.depth:
                self._complete_oldest()
                continue
            if self.waiting:
                first = self.waiting.popleft()
            else:
                first = self._next()
                if first is DONE:
                    self._complete_oldest()
                    continue
                if first is _IDLE or first is NOTHING:
                    self._refresh_stats(force=first is NOTHING)
                    continue
            if first is None:
                break
            if self.busy_since is None:
                self.busy_since = time.monotonic()
            members, group, seen = self.take_group(first, more=not stop)
            stop = stop or seen
            if members:
                flight = self.start(members, group)
                if flight is not None:
                    self.flights.append(flight)
                    if self.rt.depth > 1:
                        self.inbox.watch(flight)
            self._update_busy()
            self._refresh_stats()
        if self.fatal is not None:        # what waited for a group goes to another worker
            while self.waiting:
                q = self.waiting.popleft()
                self.reply(self._handed_back(q), q.to)
        self._settle()
        self._sweep()
        self.closing = True
        self.inbox.close()

    def _next(self) -> Queued | None | object:
        """The next queued request (None: the stop sentinel), or DONE when the oldest launched group finished
        first, or _IDLE after an idle-time capture, or NOTHING after half a second of nothing."""
        if self.flights:
            return self._request_or_done()
        item = self._get_nowait()
        if item is not NOTHING:
            return item
        if getattr(self.rt, "has_idle_work", False):
            item = self._get(IDLE_S)
            if item is not NOTHING:
                return item
            self._idle_work()
            return _IDLE
        return self._get(0.5)

    def _get(self, timeout: float) -> Queued | None | object:
        """The next request (None: stop), DONE when a launched group landed, or NOTHING after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            item = self.inbox.get(max(0.0, deadline - time.monotonic()))
            if item is NOTHING:
                return NOTHING
            done = self._landed(item)
            if done is not None:
                if done:
                    return DONE
                continue            # a stale landing: that group was answered already
            return item

    def _get_nowait(self) -> Queued | None | object:
        while True:
            item = self.inbox.get(0.0)
            if item is NOTHING:
                return NOTHING
            done = self._landed(item)
            if done is None:
                return item
            if done:
                return DONE

    def _landed(self, item: Any) -> bool | None:
        """None: not a landing; True: a launched group still waiting to be answered landed; False: a stale one."""
        if not isinstance(item, Landed):
            return None
        return any(f is item.flight for f in self.flights)

    def _request_or_done(self) -> Queued | None | object:
        """With a group launched: the next request to arrive, or DONE once the oldest launched group landed (groups
        land in launch order). Waits in the inbox: a queue the landing watch wakes, or (a worker's) the data socket
        polled with the group's event."""
        while True:
            # A waiting request first: with the device idle, launching the next group before answering the landed
            # one gets the device going sooner (the answers are in host memory; they wait a group's launch).
            item = self._get_nowait()
            if item is not NOTHING:
                return item
            if self.flights[0].job.done():
                return DONE       # its Landed was taken already (it ended the group being formed), or is on its way
            item = self._get(0.5)
            if item is not NOTHING:
                return item
            if self.fatal is not None:
                return None        # the I/O thread gave up on the device: stop, handing back what was launched

    def _more(self) -> Queued | None | object:
        """The next request for the group being formed, or DONE: launch it now.

        With nothing launched, a group takes what is queued and goes (a lone request never waits). With a group
        computing, the next one keeps taking requests as they arrive (each validated on arrival) until it is full
        or the launched group has landed: under load groups stay full, and the launch of a full group overlaps
        the compute of the one before it; otherwise the group goes the moment the device has nothing queued."""
        item = self._get_nowait()
        if item is not NOTHING:
            return item
        return self._request_or_done() if self.flights else DONE

    def _idle_work(self) -> None:
        """A missed bucket's capture, while nothing waits (a request arriving now waits for it: tens of ms)."""
        self.busy_since = time.monotonic()
        try:
            shape = self.rt.idle_work()
            log.info("worker %s: captured bucket %s while idle", self.id, shape)
        except Exception as e:  # noqa: BLE001 - a failed capture is handled in the cache; this is the device
            log.exception("worker %s: idle-time capture failed", self.id)
            if self.rt.is_cuda:
                self.fatal = f"idle-time capture: {type(e).__name__}: {e}"
        finally:
            self.busy_since = None

    def _update_busy(self) -> None:
        self.busy_since = self.flights[0].started if self.flights else None

    def _complete_oldest(self) -> None:
        self.complete(self.flights.popleft())
        self._update_busy()

    def _sweep(self) -> None:
        """Leaving: what reached this worker before the stop sentinel was read (the sentinel is read first, and a
        request the broker routed here just before the drain may still be unread). `intake` hands back what another
        worker can run; a request addressed to this worker runs here, one group each."""
        while self.fatal is None:
            item = self._get_nowait()
            if item is NOTHING:
                return
            if not isinstance(item, Queued):
                continue           # a second sentinel, or a landing (every group was answered by `_settle`)
            batch = self.admit(item)
            if batch is not None:
                group = Group(step=self.row_step)
                group.add(batch)
                self.run_group([item], group)

    def _settle(self) -> None:
        """Leaving: answer every launched group (handed back when the worker is fatal)."""
        while self.flights:
            self.complete(self.flights.popleft())
        self.busy_since = None

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_stats > 0.25:
            self.last_stats = now
            try:
                self.runtime_stats = wire.plain(self.rt.stats())
            except Exception as e:  # noqa: BLE001 - stats must never stop the worker
                self.runtime_stats = {"error": str(e)}
