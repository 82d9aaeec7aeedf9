"""The broker's jobs: the queue, the in-flight table, deduplication, and dispatch (which job goes to which worker).

- the queue is bounded (the client handlers answer "busy" when it is full); a job still queued when its caller's
  deadline passes is answered "expired" (or "no-worker" when no worker serves the model) and never dispatched, and
  a worker is handed only what is left of the deadline, so it skips work whose caller has given up;
- dispatch sends each job to the worker the pool's routing policy chooses (protocol/routing.py) among the free
  ones, with a fresh job id per dispatch;
- a job a worker lost (it died, hung, vanished, or came back with a fresh READY) goes back to the front of the
  queue for another worker, at most `max_attempts` times; one a stopping worker handed back, at most `max_bounces`
  times; never dropped silently;
- deduplication by (client id, request id): a retry of a request still queued or running waits for it (its reply
  goes to the retry's address), a retry of a finished one gets the cached reply (`broker.replies.ReplyCache`).
"""
from __future__ import annotations

import collections
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import zmq

from laya_pool.protocol import routing, wire
from laya_pool.protocol.contract import Reason, WorkerState
from laya_pool.protocol.wire import Cmd

from .config import BrokerConfig
from .metering import Meter
from .overload import DrainRate
from .replies import ReplyCache
from .sockets import Sockets
from .table import WorkerInfo, WorkerTable

log = logging.getLogger("laya-pool.broker")

SHARE_BYTES = 8 << 10


@dataclass(slots=True)
class Job:
    id: int
    kind: str                       # "request" | "describe"
    key: tuple[str, Any] | None     # (client id, client request id): the dedup key
    envelope: list[bytes]           # the client's routing frames
    client_rid: Any
    req: wire.RequestHead | None = None
    payload: list[bytes] = field(default_factory=list)
    target: str | None = None
    attempts: int = 0               # times a worker holding it was lost
    bounces: int = 0                # times a stopping worker handed it back
    worker: str | None = None
    enqueued: float = 0.0
    dispatched: float = 0.0
    nbytes: int = 0                 # payload bytes, held until the job is finished
    arrived: float = 0.0            # first arrival at this broker: end-to-end time for the metrics
    expires: float | None = None    # when its caller gives up (this broker's clock); None: no deadline


class Dispatcher:
    def __init__(self, cfg: BrokerConfig, sockets: Sockets, table: WorkerTable, meter: Meter, counters: Counter):
        self.cfg, self.sockets, self.table, self.meter, self.counters = cfg, sockets, table, meter, counters
        self.queue: collections.deque[Job] = collections.deque()
        # Describe jobs in the queue, counted: dispatch asks "any describe waiting?" on every event, and a
        # scan of a deep queue there cost more than the rest of the loop under load (benchmarks/broker_rate.py).
        self.describes_queued = 0
        self.inflight: dict[int, Job] = {}
        self.by_key: dict[tuple[str, Any], Job] = {}     # requests queued or running, by dedup key
        self.queue_bytes = 0
        self.replies = ReplyCache(cfg.cache_size, cfg.cache_max_bytes, cfg.cache_ttl_s, cfg.cache_max_reply_bytes)
        self.next_job = int.from_bytes(os.urandom(6), "little") << 8   # a restarted broker never reuses ids
        self.drain = DrainRate()                # requests leaving the queue per second: the busy hint's basis
        self.choose = routing.policy()          # the pool's routing policy, as every client's (protocol/routing.py)

    def job_id(self) -> int:
        self.next_job += 1
        return self.next_job

    def add(self, job: Job) -> None:
        """A new job at the back of the queue (a request's key and bytes held until it is finished), dispatched now
        if a worker is free."""
        if job.key is not None:
            self.by_key[job.key] = job
            self.queue_bytes += job.nbytes
        self.queue.append(job)
        self.describes_queued += job.kind == "describe"
        self.dispatch()

    def join(self, key: tuple[str, Any], envelope: list[bytes], budget_ms: int | None = None) -> bool:
        """A retry: a finished request is answered from the cache; a queued or running one is joined (its
        reply goes to the latest attempt's address, its deadline is the latest attempt's). Either way it does
        not run again. False: not seen before."""
        cached = self.replies.get(key)
        if cached is not None:
            self.counters["cache_hits"] += 1
            self.sockets.to_client(envelope, cached)
            return True
        job = self.by_key.get(key)
        if job is not None:
            self.counters["retries_joined"] += 1
            job.envelope = envelope
            if budget_ms is not None:
                job.expires = expiry(time.monotonic(), budget_ms)
            return True
        return False

    # -------------------------------------------------------------------------------------------- dispatch

    def dispatch(self) -> None:
        if not self.queue:
            return
        free = self.table.free()
        if not free and not self.describes_queued:
            return
        kept: list[Job] = []
        while self.queue:
            job = self.queue.popleft()
            w = self.pick(job, free)
            if w is None:
                kept.append(job)
                continue
            if self._send_job(w, job):
                self.describes_queued -= job.kind == "describe"
                if len(w.inflight) >= w.credit and w in free:
                    free.remove(w)
            else:
                # Unreachable: it is dead now (its jobs went back to the front of the queue).
                if w in free:
                    free.remove(w)
                kept.append(job)
            if not free and not self.describes_queued:
                break
        # The jobs passed over go back in front, in their order: the rest of a deep queue is not copied per call
        # (dispatch runs after every message).
        self.queue.extendleft(reversed(kept))

    def pick(self, job: Job, free: list[WorkerInfo]) -> WorkerInfo | None:
        """The worker `job` goes to now, by the pool's routing policy (protocol/routing.py); None: it waits."""
        if job.kind == "describe":
            return self.choose(self.table.serving())
        if job.target is not None:          # a request that names its worker goes there or waits
            w = self.table.workers.get(job.target)
            return w if w is not None and w in free and w.fits(job.req) else None
        best = self.choose(free)
        if best is None or (best.fingerprint == self.table.pool_fp and best.fits(job.req)):
            return best
        # A worker of another model came first (free only for the requests that name it), or one too small for this
        # request: choose among those that take it. The choice among all free workers is the choice among those
        # that take the request whenever it takes it, so the common case above builds nothing per request.
        fp = self.table.pool_fp
        return self.choose([w for w in free if w.fingerprint == fp and w.fits(job.req)])

    def _send_job(self, w: WorkerInfo, job: Job) -> bool:
        # A fresh id per dispatch: a late reply to an earlier attempt (the job went back to the queue and,
        # perhaps, to the same worker id) can never be taken for the answer to this one.
        job.id = self.job_id()
        now = time.monotonic()
        budget = None if job.expires is None else max(0, int((job.expires - now) * 1e3))   # what is left of it
        if job.kind == "describe":
            ok = self.sockets.to_worker(w, Cmd.DESCRIBE, {"rid": job.id})
        else:
            header = wire.request_header_for_worker(job.req, job.id, budget)
            ok = self.sockets.to_data(w, wire.encode(Cmd.REQUEST, header, *job.payload))
        if not ok:
            self.worker_lost(w, WorkerState.DEAD, "unreachable")
            return False
        job.worker, job.dispatched = w.id, now
        w.last_dispatch = job.dispatched
        self.drain.note(now)
        if job.kind == "request":
            self.meter.dispatched(job.dispatched - job.enqueued)
        w.inflight.add(job.id)
        self.inflight[job.id] = job
        return True

    def switch_model(self) -> None:
        """During a reload: serve the new model once enough workers have it (broker/table.py `switch_model`)."""
        if self.table.switch_model():
            self.dispatch()

    # -------------------------------------------------------------------------------------------- answers

    def finish(self, job: Job, frames: list[Any]) -> None:
        frames = _shared(frames)
        self.sockets.to_client(job.envelope, frames)      # first: the bookkeeping below is the broker's own
        if job.key is not None:
            self.forget(job)
            self.replies.put(job.key, frames, time.monotonic())
        self.counters["replies"] += 1

    def fail(self, job: Job, status: str, message: str, reason: Reason | None = None) -> None:
        if job.key is not None:
            self.forget(job)
        cmd = Cmd.DESCRIBE if job.kind == "describe" else Cmd.REPLY
        self.sockets.client_error(job.envelope, job.client_rid, status, message, cmd=cmd, reason=reason)

    def forget(self, job: Job) -> None:
        """A request is no longer queued or running: its key and payload bytes are released."""
        if self.by_key.pop(job.key, None) is not None:
            self.queue_bytes -= job.nbytes

    def expired(self, job: Job, where: str) -> None:
        """`job`'s caller has given up (`where`: it ran out of time in the "queue", or a "worker" skipped it).
        Counted; the answer says why, in case the caller is still listening (it stamps its budget a little
        short of its own deadline so that it can hear this): no worker serving the model, or just no time."""
        self.counters["expired"] += 1
        self.meter.expired(where)
        if where == "queue" and not self.table.serving():
            self.fail(job, wire.STATUS_RETRYABLE, "no worker is serving the model: the request waited in the queue "
                      "until its deadline", reason=Reason.NO_WORKER)
            return
        place = "in the broker's queue" if where == "queue" else "inside its worker"
        self.fail(job, wire.STATUS_RETRYABLE, f"the request's deadline passed while it waited {place}",
                  reason=Reason.EXPIRED)

    def expire_queue(self, now: float) -> None:
        """Take out of the queue what waited longer than `queue_timeout_s` for a worker (failed, retryable) and
        what its caller has given up on (its deadline passed: never dispatched, counted, answered with why)."""
        timeout = self.cfg.queue_timeout_s
        if not any(now - j.enqueued > timeout or (j.expires is not None and now >= j.expires) for j in self.queue):
            return
        kept: collections.deque[Job] = collections.deque()
        for job in self.queue:
            if job.expires is not None and now >= job.expires:
                self.describes_queued -= job.kind == "describe"
                self.expired(job, "queue")
            elif now - job.enqueued > timeout:
                self.describes_queued -= job.kind == "describe"
                self.fail(job, wire.STATUS_RETRYABLE, f"no worker took this request within {timeout:g} s",
                          reason=Reason.QUEUE_TIMEOUT)
            else:
                kept.append(job)
        self.queue = kept

    def shutdown(self) -> None:
        for job in list(self.queue) + list(self.inflight.values()):
            self.fail(job, wire.STATUS_RETRYABLE, "the broker is shutting down", reason=Reason.SHUTDOWN)
        self.queue.clear()
        self.describes_queued = 0
        self.inflight.clear()

    # -------------------------------------------------------------------------------------------- losses

    def worker_lost(self, w: WorkerInfo, state: WorkerState, why: str, lost: bool = True) -> None:
        prev = w.state
        w.state = state
        if state is WorkerState.DEAD or w.inflight:
            log.warning("worker %s (%s, pid %s) %s: %s; %d requests to re-send", w.id, prev, w.pid, state, why,
                        len(w.inflight))
        else:
            log.info("worker %s %s: %s", w.id, state, why)
        self.requeue_from(w, why, lost)
        self.switch_model()

    def requeue_from(self, w: WorkerInfo, why: str, lost: bool = True) -> None:
        for jid in sorted(w.inflight, reverse=True):
            job = self.inflight.pop(jid, None)
            if job is None:
                continue
            if lost:
                self.lost(job, w, why)
            else:
                self.bounce(job, f"workers keep handing this request back (last: worker {w.id}, {why})")
        w.inflight.clear()

    def lost(self, job: Job, w: WorkerInfo, why: str) -> None:
        """Send a job `w` lost to another worker, or fail it once `max_attempts` workers have lost it."""
        w.lost += 1
        self.counters["requeued"] += 1
        if not self.requeue(job, lost=True):
            tag = job.req.tag if job.req is not None else f"describe {job.client_rid}"
            log.warning("request %s failed: %d workers were lost while running it (last: worker %s, %s)", tag,
                        job.attempts, w.id, why, extra={"request": tag})
            self.fail(job, wire.STATUS_FINAL, f"{job.attempts} workers were lost while running this request "
                                              f"(last: worker {w.id}, {why})", reason=Reason.WORKERS_LOST)

    def bounce(self, job: Job, message: str) -> None:
        """`job` back to the queue as a hand-back, or failed once it has been handed back max_bounces times. One
        addressed to a worker waits there for that worker's return (a restart, a reload): failing it at once would
        fail a call whose worker is back in seconds; one whose worker stays down fails when its
        deadline or --queue-timeout runs out."""
        if not self.requeue(job, lost=False):
            self.fail(job, wire.STATUS_RETRYABLE, message, reason=Reason.BOUNCED)

    def requeue(self, job: Job, *, lost: bool) -> bool:
        """Back to the front of the queue, counting a lost attempt (`lost`) or a hand-back; False, and the
        job left for the caller to fail, once it has used up `max_attempts` / `max_bounces`."""
        worker, job.worker = job.worker, None
        if lost:
            job.attempts += 1
            spent = job.attempts >= self.cfg.max_attempts
        else:
            job.bounces += 1
            spent = job.bounces > self.cfg.max_bounces
        if not spent:
            job.enqueued = time.monotonic()
            self.queue.appendleft(job)
            if job.kind == "request":
                self.meter.requeued(worker, lost)
            self.describes_queued += job.kind == "describe"
        return not spent


def expiry(now: float, budget_ms: int | None) -> float | None:
    """When a request's caller gives up, on this broker's clock: its budget counts from its arrival here."""
    return None if budget_ms is None else now + budget_ms / 1e3


def _shared(frames: list[Any]) -> list[Any]:
    """Large frames as zmq.Frames: ZeroMQ then shares one buffer among every send of it (a cached reply sent
    to each retry) instead of copying it per send, so a peer cannot multiply the broker's memory by asking."""
    return [zmq.Frame(f) if isinstance(f, bytes) and len(f) >= SHARE_BYTES else f for f in frames]
