"""The worker's compute thread: admit each queued request, take a group, run it, answer every member.

Words: a *request* is what the broker sent (`wire.Request`, queued here as `Queued`); a *batch* is rows
the runtime runs in one forward (`worker.batch.Batch`: one request's rows, or a group's merged); a
*group* is the requests that share one forward (`worker.merge.Group`, dynamic batching).

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
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from laya_pool.protocol import settings, wire
from laya_pool.protocol.contract import Reason
from laya_pool.protocol.histogram import SECONDS_BOUNDS, Histogram

from .batch import Batch, RequestError
from .inbox import NOTHING, QueueInbox
from .landing import Landed
from .merge import Group

log = logging.getLogger("laya-pool.worker")

_DONE, _IDLE = object(), object()    # what `_next` returns besides a queued request (and NOTHING)
# Nothing launched and nothing arriving for this long: idle enough to capture a missed bucket (a request that
# arrives during the capture waits for it, tens of ms, once per bucket; a short gap in steady traffic does not count).
IDLE_S = 0.005
# Padding tokens a group's forward may hold beyond what its members pad to alone (--merge-waste); a request that would
# take it past waits for another group. About what a forward's fixed cost buys (1x48 replays in ~1 ms; a token costs
# 1.3-1.9 us on an H100), so past it a second forward is cheaper than more padding: a mixed load ran 1.5-1.7x
# faster with the bound (docs/decisions/0013-merge-waste-bound.md).
MERGE_WASTE = 512
BUNDLE_MOST = 64        # replies in one BUNDLE (--max-batch has no bound; a bundle's header grows ~66 bytes a reply)


@dataclass
class Queued:
    """A request taken from the broker, waiting for (or in) the compute thread."""
    session: int          # the registration it arrived under
    req: wire.Request
    received: float       # time.monotonic() when the I/O thread decoded it
    expires: float | None = None   # when its caller gives up (this host's monotonic clock); None: no deadline
    to: Any = None     # a client's own request: its identity on the direct socket, or its lane (None: the broker's)

    @classmethod
    def of(cls, session: int, req: wire.Request, received: float, to: Any = None) -> Queued:
        """`req` as it arrived at `received`: its budget (the caller's time left) counts from then."""
        expires = None if req.budget_ms is None else received + req.budget_ms / 1e3
        return cls(session, req, received, expires, to)


@dataclass
class Flight:
    """A launched group: its members, their rows in the same order, and the runtime's handle."""
    members: list[Queued]
    group: Group
    job: Any              # runtime.Launched
    started: float        # time.monotonic() just before the launch
    launched: float = 0.0 # time.monotonic() once the launch returned (the device has its work)


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


class Compute:
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
        self.busy_since: float | None = None   # when the oldest unanswered group was taken (the I/O thread's watchdog)
        self.flights: deque[Flight] = deque()   # launched, not yet answered, oldest first
        self.waiting: deque[Queued] = deque()   # taken, set aside by a group (`take_group`), oldest first
        if hasattr(runtime, "before_capture"):
            runtime.before_capture = self.inbox.quiesce

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
                if first is _DONE:
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
        """The next queued request (None: the stop sentinel), or _DONE when the oldest launched group finished
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
        """The next request (None: stop), _DONE when a launched group landed, or NOTHING after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            item = self.inbox.get(max(0.0, deadline - time.monotonic()))
            if item is NOTHING:
                return NOTHING
            done = self._landed(item)
            if done is not None:
                if done:
                    return _DONE
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
                return _DONE

    def _landed(self, item: Any) -> bool | None:
        """None: not a landing; True: a launched group still waiting to be answered landed; False: a stale one."""
        if not isinstance(item, Landed):
            return None
        return any(f is item.flight for f in self.flights)

    def _request_or_done(self) -> Queued | None | object:
        """With a group launched: the next request to arrive, or _DONE once the oldest launched group landed (groups
        land in launch order). Waits in the inbox: a queue the landing watch wakes, or (a worker's) the data socket
        polled with the group's event."""
        while True:
            # A waiting request first: with the device idle, launching the next group before answering the landed
            # one gets the device going sooner (the answers are in host memory; they wait a group's launch).
            item = self._get_nowait()
            if item is not NOTHING:
                return item
            if self.flights[0].job.done():
                return _DONE       # its Landed was taken already (it ended the group being formed), or is on its way
            item = self._get(0.5)
            if item is not NOTHING:
                return item
            if self.fatal is not None:
                return None        # the I/O thread gave up on the device: stop, handing back what was launched

    def _more(self) -> Queued | None | object:
        """The next request for the group being formed, or _DONE: launch it now.

        With nothing launched, a group takes what is queued and goes (a lone request never waits). With a group
        computing, the next one keeps taking requests as they arrive (each validated on arrival) until it is full
        or the launched group has landed: under load groups stay full, and the launch of a full group overlaps
        the compute of the one before it; otherwise the group goes the moment the device has nothing queued."""
        item = self._get_nowait()
        if item is not NOTHING:
            return item
        return self._request_or_done() if self.flights else _DONE

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

    def admit(self, q: Queued) -> Batch | None:
        """The request's rows if this worker can run them; otherwise answer it here and return None."""
        req = q.req
        if self.faults.hang_rows and len(req.lengths) == self.faults.hang_rows:
            log.warning("worker %s: LAYA_WORKER_HANG_ROWS: hanging on request %s", self.id, req.tag,
                        extra={"request": req.tag})
            threading.Event().wait()
        if q.session != self.session and q.to is None:     # (a client's own request is no broker's to re-send)
            self.counts["dropped"] += 1
            self.reply(self._error(req, wire.STATUS_RETRYABLE, "dropped after re-registering", reason=Reason.STALE),
                       q.to)
            return None
        if q.expires is not None and time.monotonic() >= q.expires:
            # Its caller has given up: computing it would only delay the requests behind it.
            self.counts["expired"] += 1
            self.reply(self._error(req, wire.STATUS_RETRYABLE, f"worker {self.id}: the request's deadline passed "
                                   "before compute started", reason=Reason.EXPIRED), q.to)
            return None
        try:
            batch = Batch(req.ids, req.lengths, req.types, req.marker_counts, req.markers)    # (0.2 us; by names 0.7)
            # (its arrays are parse_request's; its values are checked with its group's, `_valid`)
            self.rt.check_request(batch, mode=req.mode, taps=req.taps, parsed=True)
            return batch
        except Exception as e:  # noqa: BLE001 - host-side only (no device work yet): refuse this one request
            self._refuse(q, e, "read")
            return None

    def _refuse(self, q: Queued, e: Exception, doing: str) -> None:
        """Answer `q`, whose host-side check raised `e`: a `RequestError` names its field and row; anything else is
        an internal error of this request alone (no device work was done for it)."""
        if isinstance(e, RequestError):
            self.counts["request_errors"] += 1
            self.reply(self._refusal(q.req, e), q.to)
            return
        self.counts["internal_errors"] += 1
        log.exception("worker %s: could not %s request %s", self.id, doing, q.req.tag, extra={"request": q.req.tag})
        self.reply(self._internal(q.req, e), q.to)

    def take_group(self, first: Queued, more: bool = True) -> tuple[list[Queued], Group, bool]:
        """`first` and the requests that can share its forward: (the members, their rows as a Group in the same
        order, whether the stop sentinel was seen). Requests set aside before (`waiting`) are offered first, then
        what arrives (`more`: the sentinel is not read yet).

        Only requests in the worker's own mode without taps are merged; one that asks for something else
        runs alone. A request that would overflow the workspace ends the group; one that would take the group's
        padding (`Group.waste`) past `merge_waste` tokens is set aside, and the group goes on without it. What is
        set aside stays in arrival order, first in line for the next group."""
        members: list[Queued] = []
        group = Group(step=self.row_step)
        earlier, self.waiting = self.waiting, deque()
        kept: list[Queued] = []           # set aside from `earlier`: older than what is left there
        later: list[Queued] = []          # set aside from new arrivals
        stop = False
        q: Queued | None = first
        aside = later                     # where `q` goes if set aside (`first` is never: it leads the group)
        try:
            while q is not None:
                special = q.req.taps or q.req.mode not in (None, self.rt.config.mode)
                if members and special:
                    aside.append(q)
                    break
                batch = self.admit(q)
                if batch is not None:
                    if members and not group.admits(batch, self.rt.capacity):
                        aside.append(q)
                        break
                    if members and self.merge_waste is not None and group.waste(batch) > self.merge_waste:
                        self.counts["set_aside"] += 1
                        aside.append(q)
                    else:
                        group.add(batch)
                        members.append(q)
                        if special:
                            break
                # Enough set aside for a group of their own: launch this one, they come next.
                if len(members) >= self.max_group or len(kept) + len(later) >= self.max_group:
                    break
                aside = kept if earlier else later
                nxt = earlier.popleft() if earlier else (self._more() if more else _DONE)
                if nxt is _DONE:
                    break
                if nxt is None:
                    stop = True
                    break
                q = nxt
        finally:                          # (an answer that raised must not drop what waits)
            self.waiting.extend(kept)
            self.waiting.extend(earlier)
            self.waiting.extend(later)
        return members, group, stop

    def run_group(self, members: list[Queued], group: Group) -> None:
        """One forward for the whole group, one reply per member, answered before this returns."""
        flight = self.start(members, group)
        if flight is not None:
            self.complete(flight)

    def start(self, members: list[Queued], group: Group) -> Flight | None:
        """Launch the group's forward; its replies come from `complete`. A launch that fails is answered here
        (None)."""
        from .upload import UploadError  # imports the CUDA runtime bindings: not before main() has

        if self.fatal is not None:       # an earlier member broke the device: hand the rest to another worker
            for q in members:
                self.reply(self._handed_back(q), q.to)
            return None
        # Outside the guard below: a refusal sent here is not the run's failure (its member would be answered twice).
        members, group = self._valid(members, group)
        if not members:
            return None
        try:
            return self._launch(members, group)
        except UploadError as e:
            if e.sticky:
                # The copy failed because the context is poisoned (an earlier kernel faulted): nothing more can run
                # here. Hand the group back and leave; the supervisor starts a fresh worker.
                self.counts["internal_errors"] += 1
                log.error("worker %s: %s: the device context is broken, leaving", self.id, e)
                for q in members:
                    self.reply(self._handed_back(q, "the device context broke"), q.to)
                self.fatal = f"upload on a broken context: {e}"
                return None
            # The group drained before raising, so the staging is safe to reuse: keep serving, and let
            # the broker run these requests elsewhere.
            self.counts["upload_errors"] += 1
            tags = ", ".join(q.req.tag for q in members)
            log.warning("worker %s: %s (requests %s, handed back)", self.id, e, tags, extra={"request": tags})
            for q in members:
                self.reply(self._error(q.req, wire.STATUS_RETRYABLE, f"worker {self.id}: {e}",
                                       reason=Reason.UPLOAD_FAILED), q.to)
            return None
        except Exception as e:  # noqa: BLE001 - every failure must be answered
            self._recover(members, group, e)
            return None

    def complete(self, flight: Flight) -> None:
        """Wait for a launched group and answer every member."""
        members, group = flight.members, flight.group
        if self.fatal is not None:       # the device may be broken or hung: do not wait on it
            for q in members:
                self.reply(self._handed_back(q), q.to)
            return
        try:
            replies = self._answer(flight)
        except Exception as e:  # noqa: BLE001 - every failure must be answered
            self._recover(members, group, e)
            return
        if len(members) > 1:
            self.counts["merged_runs"] += 1
            self.counts["merged_requests"] += len(members)
        self.counts["ok"] += len(members)
        for to, frames, answers in replies:
            self.reply(frames, to, answers)
        now = time.monotonic()
        for q in members:
            self.answer_seconds.observe(now - q.received)

    def _recover(self, members: list[Queued], group: Group, e: Exception) -> None:
        if len(members) > 1:
            # Each member passed alone, so run them alone: whatever failed finds its owner, and the
            # others are answered here instead of each losing an attempt with the group.
            for q, batch in zip(members, group.batches):
                self.run_group([q], Group([batch]))
            return
        self.fail(members[0], e)

    def _valid(self, members: list[Queued], group: Group) -> tuple[list[Queued], Group]:
        """The members whose rows' values pass, and their group; each other one refused, naming its field and row.

        `admit` checked each request's structure, so the merged rows line up with the members' and one check of the
        group's values passes exactly when every member's would (worker/batch.py `validate_structure`): ~30 numpy
        and list passes a group instead of a member. Only a group that fails is checked member by member. Host work
        alone, so anything it raises is one request's refusal (as in `admit`), never a device failure."""
        try:
            self.rt.check_values(group.merged())
            return members, group
        except Exception:  # noqa: BLE001 - whose rows they are is found member by member
            pass
        kept: list[Queued] = []
        batches = []
        for q, batch in zip(members, group.batches):
            try:
                self.rt.check_values(batch)
            except Exception as e:  # noqa: BLE001 - host-side only: refuse this one request
                self._refuse(q, e, "check")
                continue
            kept.append(q)
            batches.append(batch)
        return kept, Group(batches)

    def _launch(self, members: list[Queued], group: Group) -> Flight:
        """Launch the group (inside the caller's guard: a failure here is the run's)."""
        started = time.monotonic()
        first = members[0].req
        if self.faults.fault_rows and any(b.rows == self.faults.fault_rows for b in group.batches):
            raise RuntimeError(f"LAYA_WORKER_FAULT_ROWS: injected fault on a group with a {self.faults.fault_rows}"
                               "-row request")
        # Every member passed `check` in admit and the group fits the workspace: no second validation.
        job = self.rt.launch(group.merged(), mode=first.mode, taps=first.taps, checked=True)
        return Flight(members, group, job, started, time.monotonic())

    def _answer(self, flight: Flight) -> list[tuple[Any, list[Any], int]]:
        """Wait for the group and build its replies (inside the caller's guard): (to, frames, requests answered).

        A client that reads bundles (`wire.accepts_bundles`: the asyncio client, on the direct socket) gets the
        replies to all its requests of this forward in one BUNDLE: at load a forward answers ~32 requests of a few
        clients, and a reply alone costs the data thread 6 us to encode and send, one of 8 in a bundle 1.8
        (docs/decisions/0017-bundles-on-requests-opt-in.md). Lanes carry one request at a time, the broker reads
        REPLYs: those go alone."""
        res = self.rt.finish(flight.job)
        done = time.monotonic()
        members, t0 = flight.members, flight.started
        # received_at ... done_at: this host's monotonic clock, so a client on the same host can place the worker's
        # part of a round trip, hand-offs included (benchmarks/overhead.py); meaningless across hosts. What the members
        # share is packed once (wire.Replies).
        answers = wire.Replies(worker=self.id, fingerprint=self.fingerprint, together=True, metrics=dict(
            res.metrics, batched=len(members), started_at=t0, launched_at=flight.launched,
            landed_at=getattr(flight.job, "landed_at", None) or done, done_at=done))
        encode = answers.alone if len(members) == 1 else answers.encode    # (a lone reply: packed whole)
        replies: list[tuple[Any, list[Any], int]] = []
        bundles: dict[bytes, list[tuple[Any, Any, Any, dict]]] = {}
        for q, (logits, act) in zip(members, flight.group.split(res.logits, res.act)):
            own = {"queue_ms": (t0 - q.received) * 1e3, "worker_ms": (done - q.received) * 1e3,
                   "received_at": q.received}
            if type(q.to) is bytes and res.taps is None and wire.accepts_bundles(q.req.header):
                bundles.setdefault(q.to, []).append((q.req.rid, logits, act, own))
            else:
                replies.append((q.to, encode(q.req.rid, logits, act, own, taps=res.taps), 1))
        for to, items in bundles.items():
            if len(items) == 1:
                replies.append((to, encode(*items[0]), 1))
                continue
            for at in range(0, len(items), BUNDLE_MOST):       # (a header stays far below the wire's 64 KiB)
                part = items[at:at + BUNDLE_MOST]
                self.counts["bundles"] += 1
                self.counts["bundled"] += len(part)
                replies.append((to, answers.bundle(part), len(part)))
        return replies

    def fail(self, q: Queued, e: Exception) -> None:
        """Answer one request whose run raised `e`."""
        if isinstance(e, RequestError):
            self.counts["request_errors"] += 1
            self.reply(self._refusal(q.req, e), q.to)
            return
        self.counts["internal_errors"] += 1
        if self.rt.is_cuda:
            log.exception("worker %s: device failure on request %s", self.id, q.req.tag, extra={"request": q.req.tag})
            self.reply(self._handed_back(q, type(e).__name__), q.to)
            self.fatal = f"{type(e).__name__}: {e}"     # the context may be poisoned
            return
        log.exception("worker %s: internal error on request %s", self.id, q.req.tag, extra={"request": q.req.tag})
        self.reply(self._internal(q.req, e), q.to)

    # -- replies ---------------------------------------------------------------------------------------------
    def _error(self, req: wire.Request, status: str, message: str, **kw: Any) -> list[Any]:
        return wire.encode_error(req.rid, status, message, worker=self.id, **kw)

    def _refusal(self, req: wire.Request, e: RequestError) -> list[Any]:
        return self._error(req, wire.STATUS_FINAL, str(e), field=e.field, row=e.row)

    def _internal(self, req: wire.Request, e: Exception) -> list[Any]:
        return self._error(req, wire.STATUS_FINAL, f"internal error: {type(e).__name__}: {e}", reason=Reason.INTERNAL)

    def _handed_back(self, q: Queued, why: str = "an earlier request broke the device") -> list[Any]:
        return self._error(q.req, wire.STATUS_RETRYABLE, f"worker {self.id} failed ({why}); another worker will run it",
                           reason=Reason.WORKER_FAULT)

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_stats > 0.25:
            self.last_stats = now
            try:
                self.runtime_stats = wire.plain(self.rt.stats())
            except Exception as e:  # noqa: BLE001 - stats must never stop the worker
                self.runtime_stats = {"error": str(e)}
