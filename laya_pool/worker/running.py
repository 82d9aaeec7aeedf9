"""Running a group: one forward for its members, launched now and answered when it lands, one reply per member
whatever happens (a failed member is refused alone, a merged group whose run fails runs its members alone, a device
failure hands the group back and makes the worker fatal).

A mixin of `Compute` (worker/compute.py), which holds the runtime (`rt`), the worker's id and fingerprint, the
counters, the fault hooks, `reply` and `fatal`, and checks a group's values (`_valid`, worker/grouping.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from laya_pool.protocol import wire
from laya_pool.protocol.contract import Reason

from .batch import RequestError
from .grouping import Queued
from .merge import Group

log = logging.getLogger("laya-pool.worker")

BUNDLE_MOST = 64        # replies in one BUNDLE (--max-batch has no bound; a bundle's header grows ~66 bytes a reply)


@dataclass
class Flight:
    """A launched group: its members, their rows in the same order, and the runtime's handle."""
    members: list[Queued]
    group: Group
    job: Any              # runtime.Launched
    started: float        # time.monotonic() just before the launch
    launched: float = 0.0 # time.monotonic() once the launch returned (the device has its work)


class Running:
    """Launching and answering groups, for `Compute`."""

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
