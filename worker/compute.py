"""The worker's compute thread: admit each queued request, take a group, run it, answer every member.

Words: a *request* is what the broker sent (`wire.Request`, queued here as `Queued`); a *batch* is rows
the runtime runs in one forward (`worker.batch.Batch`: one request's rows, or a group's merged); a
*group* is the requests that share one forward (`worker.merge.Group`, dynamic batching).

The thread owns the runtime. It takes requests from a queue the I/O thread fills, and hands every
encoded reply back through `reply` (the I/O thread's inproc PAIR socket: ZeroMQ sockets are never
shared between threads). Every request gets exactly one reply:

- refused by validation (`RequestError`): "final", naming field and row; the worker keeps serving;
- queued before the worker registered again: "retryable" (stale), its client retries through the new session;
- a failed upload (drained before raising): "retryable" (upload-failed); the worker keeps serving;
- a merged group whose run fails: its members run alone, so the failure finds its owner;
- anything else on CUDA: "retryable" (worker-fault) and the worker is fatal (the context may be poisoned).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from protocol import wire
from protocol.contract import Reason
from worker.batch import Batch, RequestError
from worker.merge import Group

log = logging.getLogger("laya-pool.worker")


@dataclass
class Queued:
    """A request taken from the broker, waiting for (or in) the compute thread."""
    session: int          # the registration it arrived under
    req: wire.Request
    received: float       # time.monotonic() when the I/O thread decoded it


@dataclass(frozen=True)
class FaultHooks:
    """Test hooks for faults no CPU can cause, read from the environment by `main` and handed in here.

    hang_rows: block (as a hung device would) on any request of that many rows; the I/O thread keeps
    heartbeating. fault_rows: raise inside the run of any group holding a request of that many rows (what
    a device fault or a runtime bug looks like from here). 0: off."""
    hang_rows: int = 0
    fault_rows: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> FaultHooks:
        return cls(hang_rows=int(env.get("LAYA_WORKER_HANG_ROWS", "0") or 0),
                   fault_rows=int(env.get("LAYA_WORKER_FAULT_ROWS", "0") or 0))


class Compute:
    def __init__(self, runtime: Any, worker_id: str, fingerprint: str, max_group: int,
                 reply: Callable[[list[Any]], None], counts: dict[str, int], faults: FaultHooks = FaultHooks()):
        self.rt, self.id, self.fingerprint = runtime, worker_id, fingerprint
        self.max_group = max_group        # requests merged into one forward (--max-batch)
        self.reply, self.counts, self.faults = reply, counts, faults
        self.queue: queue.Queue[Queued | None] = queue.Queue()   # None: stop once what is before it is done
        self.session = 0                  # the I/O thread's registration; older requests are stale
        self.fatal: str | None = None     # set when the device may be broken; the I/O thread then leaves
        self.runtime_stats: dict[str, Any] = {}
        self.last_stats = 0.0
        self.busy_since: float | None = None   # when the group being run was taken (the I/O thread's watchdog)

    def loop(self) -> None:
        """The thread's body: until the stop sentinel, or until the worker is fatal."""
        held: Queued | None = None        # taken from the queue, but could not join the last group
        while self.fatal is None:
            if held is not None:
                first, held = held, None
            else:
                try:
                    first = self.queue.get(timeout=0.5)
                except queue.Empty:
                    self._refresh_stats(force=True)
                    continue
            if first is None:
                break
            self.busy_since = time.monotonic()
            members, group, held, stop = self.take_group(first)
            if members:
                self.run_group(members, group)
            self.busy_since = None
            self._refresh_stats()
            if stop:
                break

    def admit(self, q: Queued) -> Batch | None:
        """The request's rows if this worker can run them; otherwise answer it here and return None."""
        req = q.req
        if self.faults.hang_rows and len(req.lengths) == self.faults.hang_rows:
            log.warning("worker %s: LAYA_WORKER_HANG_ROWS: hanging on request %s", self.id, req.tag,
                        extra={"request": req.tag})
            threading.Event().wait()
        if q.session != self.session:
            self.counts["dropped"] += 1
            self.reply(self._error(req, wire.STATUS_RETRYABLE, "dropped after re-registering", reason=Reason.STALE))
            return None
        try:
            batch = Batch(**req.arrays())
            self.rt.check(batch, mode=req.mode, taps=req.taps)
            return batch
        except RequestError as e:
            self.counts["request_errors"] += 1
            self.reply(self._refusal(req, e))
            return None
        except Exception as e:  # noqa: BLE001 - host-side only (no device work yet): refuse this one request
            self.counts["internal_errors"] += 1
            log.exception("worker %s: could not read request %s", self.id, req.tag, extra={"request": req.tag})
            self.reply(self._internal(req, e))
            return None

    def take_group(self, first: Queued) -> tuple[list[Queued], Group, Queued | None, bool]:
        """`first` and the queued requests that can share its forward: (the members, their rows as a Group in
        the same order, a request held back for the next group, whether the stop sentinel was seen).

        Only requests in the worker's own mode without taps are merged; one that asks for something else
        runs alone. A request that would overflow the workspace waits for the next group."""
        members: list[Queued] = []
        group = Group()
        q: Queued | None = first
        while q is not None:
            special = q.req.taps or q.req.mode not in (None, self.rt.config.mode)
            if members and special:
                return members, group, q, False
            batch = self.admit(q)
            if batch is not None:
                if members and not group.admits(batch, self.rt.capacity):
                    return members, group, q, False
                group.add(batch)
                members.append(q)
                if special:
                    break
            if len(members) >= self.max_group:
                break
            try:
                q = self.queue.get_nowait()
            except queue.Empty:
                break
            if q is None:
                return members, group, None, True
        return members, group, None, False

    def run_group(self, members: list[Queued], group: Group) -> None:
        """One forward for the whole group, one reply per member."""
        from worker.upload import UploadError  # imports the CUDA runtime bindings: not before main() has

        if self.fatal is not None:       # an earlier member broke the device: hand the rest to another worker
            for q in members:
                self.reply(self._handed_back(q))
            return
        try:
            replies = self._forward(members, group)
        except UploadError as e:
            # The group drained before raising, so the staging is safe to reuse: keep serving, and let
            # the broker run these requests elsewhere.
            self.counts["upload_errors"] += 1
            tags = ", ".join(q.req.tag for q in members)
            log.warning("worker %s: %s (requests %s, handed back)", self.id, e, tags, extra={"request": tags})
            for q in members:
                self.reply(self._error(q.req, wire.STATUS_RETRYABLE, f"worker {self.id}: {e}",
                                       reason=Reason.UPLOAD_FAILED))
            return
        except Exception as e:  # noqa: BLE001 - every failure must be answered
            if len(members) > 1:
                # Each member passed alone, so run them alone: whatever failed finds its owner, and the
                # others are answered here instead of each losing an attempt with the group.
                for q, batch in zip(members, group.batches):
                    self.run_group([q], Group([batch]))
                return
            self.fail(members[0], e)
            return
        if len(members) > 1:
            self.counts["merged_runs"] += 1
            self.counts["merged_requests"] += len(members)
        self.counts["ok"] += len(members)
        for frames in replies:
            self.reply(frames)

    def _forward(self, members: list[Queued], group: Group) -> list[list[Any]]:
        """Run the group and build every member's reply (inside the caller's guard: a failure here is the run's)."""
        t0 = time.monotonic()
        first = members[0].req
        if self.faults.fault_rows and any(b.rows == self.faults.fault_rows for b in group.batches):
            raise RuntimeError(f"LAYA_WORKER_FAULT_ROWS: injected fault on a group with a {self.faults.fault_rows}"
                               "-row request")
        # Every member passed `check` in admit and the group fits the workspace: no second validation.
        res = self.rt.run(group.merged(), mode=first.mode, taps=first.taps, checked=True)
        done = time.monotonic()
        replies = []
        for q, (logits, act) in zip(members, group.split(res.logits, res.act)):
            # received_at / done_at: this host's monotonic clock, so a client on the same host can place the
            # worker's part of a round trip (scripts/overhead.py); meaningless across hosts.
            metrics = dict(res.metrics, batched=len(members), queue_ms=(t0 - q.received) * 1e3,
                           worker_ms=(done - q.received) * 1e3, received_at=q.received, done_at=done)
            replies.append(wire.encode_reply(q.req.rid, logits, act, worker=self.id, fingerprint=self.fingerprint,
                                             metrics=metrics, taps=res.taps))
        return replies

    def fail(self, q: Queued, e: Exception) -> None:
        """Answer one request whose run raised `e`."""
        if isinstance(e, RequestError):
            self.counts["request_errors"] += 1
            self.reply(self._refusal(q.req, e))
            return
        self.counts["internal_errors"] += 1
        if self.rt.is_cuda:
            log.exception("worker %s: device failure on request %s", self.id, q.req.tag, extra={"request": q.req.tag})
            self.reply(self._handed_back(q, type(e).__name__))
            self.fatal = f"{type(e).__name__}: {e}"     # the context may be poisoned
            return
        log.exception("worker %s: internal error on request %s", self.id, q.req.tag, extra={"request": q.req.tag})
        self.reply(self._internal(q.req, e))

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
