"""What the broker does with a worker's message (the backend), and the workers' liveness.

A worker registers with READY (checked and put in the table: broker/table.py), then sends heartbeats, replies,
model cards, and says when it drains or leaves. A READY is refused (DISCONNECT saying why, a log line) when it does
not prove that the pool started the worker (`proof`: an HMAC of its socket identity under the worker secret the
broker writes to the run directory, protocol/credentials.py; asked where neither CURVE keys nor --insecure-backend
say otherwise), and when it names the id of a worker still connected on another socket (a second process with a
live worker's id, by mistake or not: ZeroMQ's handover, which let it take the route, is off).

Heartbeats go both ways (Paranoid Pirate): a worker silent for `liveness` intervals is dead, and so is one holding a
request longer than `job_timeout_s` (its heartbeats come from its I/O thread, so a hung device still looks alive); a
dead worker's jobs go to another (broker/dispatch.py). A message from a worker the broker does not know gets
DISCONNECT, so the worker registers again.
"""
from __future__ import annotations

import logging
import time
from collections import Counter

import zmq

from laya_pool.protocol import credentials, wire
from laya_pool.protocol.contract import Leave, Reason, WorkerState
from laya_pool.protocol.wire import Cmd

from .config import BrokerConfig
from .dispatch import Dispatcher, Job
from .metering import Meter
from .monitor import LogLimiter
from .sockets import Sockets
from .table import WorkerInfo, WorkerTable

log = logging.getLogger("laya-pool.broker")

FORGET_AFTER_S = 600.0          # dead entries stay in the status table this long


class WorkerHandlers:
    def __init__(self, cfg: BrokerConfig, sockets: Sockets, table: WorkerTable, dispatcher: Dispatcher,
                 meter: Meter, counters: Counter, say: LogLimiter):
        self.cfg, self.sockets, self.table, self.dispatcher = cfg, sockets, table, dispatcher
        self.meter, self.counters, self.say = meter, counters, say
        self.hb = cfg.heartbeat_ms / 1000.0
        self.token, self.token_path = None, None
        if cfg.worker_secret and not cfg.keys and not cfg.insecure_backend:
            # After binding, as the operator secret: a broker that could not bind never replaces a pool's secret.
            self.token, self.token_path = credentials.publish(credentials.WORKER, cfg.backend)
            log.info("workers register with the proof of the worker secret in %s (`laya-pool workers` under another "
                     "run directory: --worker-secret-file)", self.token_path)

    def close(self) -> None:
        if self.token_path is not None:
            credentials.remove(self.token_path, self.token)

    def on_message(self, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        now = time.monotonic()
        try:
            msg = wire.decode(body)
        except wire.ProtocolError as e:
            self.counters["worker_malformed"] += 1
            log.warning("worker %r sent a malformed message (%s)", identity, e)
            self._confused(identity, f"malformed message: {e}", like=body)
            return
        w = self.table.of(identity)
        if msg.cmd == Cmd.READY:
            try:
                self.on_ready(identity, msg, now)
            except wire.ProtocolError as e:
                log.warning("worker %r sent a bad READY (%s)", identity, e)
                self.sockets.disconnect(identity, f"bad READY: {e}")
            return
        if w is None or not w.state.connected:
            # A worker we do not know (we restarted, or declared it dead): make it register again.
            if msg.cmd != Cmd.DISCONNECT:
                self.sockets.disconnect(identity, Leave.NOT_REGISTERED)
            return
        w.last_seen, w.expiry = now, now + self.hb * self.cfg.liveness
        try:
            self._on_worker_message(w, msg)
        except wire.ProtocolError as e:
            self.counters["worker_malformed"] += 1
            log.warning("worker %s sent a bad %s (%s)", w.id, msg.cmd.name, e)
            self._confused(identity, str(e))
        self.dispatcher.dispatch()

    def _on_worker_message(self, w: WorkerInfo, msg: wire.Message) -> None:
        """A message from a registered worker (READY is handled before: it is how a worker gets here)."""
        if msg.cmd == Cmd.HEARTBEAT:
            stats = wire.get(msg.header, "stats", dict, default=None)
            if stats is not None:
                w.stats = stats
        elif msg.cmd == Cmd.REPLY:
            self.on_reply(w, msg)
        elif msg.cmd == Cmd.DESCRIBE:
            self.on_card(w, msg)
        elif msg.cmd == Cmd.DRAIN:
            # The worker drains on its own (SIGTERM): dispatch nothing more to it.
            if w.state is WorkerState.READY:
                w.state = WorkerState.DRAINING
                log.info("worker %s: draining (%s)", w.id, msg.header.get("reason", "its own decision"))
                self.dispatcher.switch_model()
        elif msg.cmd == Cmd.DISCONNECT:
            reason = wire.get(msg.header, "reason", str, default=Leave.SHUTDOWN)
            state = {Leave.DRAIN: WorkerState.DRAINED, Leave.RESTART: WorkerState.RESTARTING}.get(
                reason, WorkerState.STOPPED)
            # A worker that leaves in good order answered all it read; a request still counted here was on its way
            # to it (its data socket is not ordered with its control socket): a hand-back, not a lost attempt.
            self.dispatcher.worker_lost(w, state, f"left ({reason})",
                                        lost=reason not in (Leave.DRAIN, Leave.RESTART, Leave.SHUTDOWN))
        else:
            raise wire.ProtocolError("command", f"{msg.cmd.name} is not a worker command")

    def _confused(self, identity: bytes, why: str, like: list[bytes] | None = None) -> None:
        """`like`: the undecodable message this answers (a LAYA2 worker gets its DISCONNECT in LAYA2's layout, so it
        logs the reason, naming `version`, instead of failing on the framing)."""
        wid = self.table.by_identity.get(identity)
        if wid is not None and wid in self.table.workers:
            self.dispatcher.worker_lost(self.table.workers[wid], WorkerState.DEAD, why)
        self.sockets.disconnect(identity, why[:200], like)

    def on_ready(self, identity: bytes, msg: wire.Message, now: float) -> None:
        if not self._admissible(identity, msg.header):
            return
        w = self.table.admit(identity, msg.header, now, self.hb * self.cfg.liveness)
        old = self.table.workers.get(w.id)
        if old is not None and old.state.live and old.inflight:
            # The same id registered again: the old process (and its work) is gone.
            self.dispatcher.requeue_from(old, "re-registered")
        self.table.add(w)
        self.sockets.to_worker(w, Cmd.HEARTBEAT, {})
        log.info("worker %s ready: %s pid %s, credit %d, fingerprint %s (registration %d)", w.id, w.device, w.pid,
                 w.credit, w.fingerprint[:12], w.registrations)
        self.dispatcher.switch_model()
        self.dispatcher.dispatch()

    def _admissible(self, identity: bytes, h: dict) -> bool:
        """Whether a READY may register: its proof (where the pool asks for one), and no live worker of its id on
        another socket. A refusal is counted, logged (one line per kind every 10 s) and told to the peer."""
        wid = wire.get(h, "id", str)
        if self.token is not None and not credentials.proves(h.get("proof"), self.token, identity):
            kind, why = "proof", (f"this pool takes only the workers it started: READY's `proof` must come from the "
                                  f"worker secret in the pool's run directory ({credentials.runtime_dir()}), which a "
                                  "laya-pool worker of this user reads itself; a broker with --insecure-backend takes "
                                  "any worker")
        else:
            old = self.table.workers.get(wid)
            if old is None or not old.state.connected or old.identity == identity:
                return True
            if not self.sockets.to_worker(old, Cmd.HEARTBEAT, {}):
                return True         # its socket is gone (the process died): this is its successor
            kind, why = "taken", (f"worker id {wid!r} is held by a live worker (pid {old.pid}) on another socket; "
                                  "give each worker its own --id")
        self.counters["workers_refused"] += 1
        self.say(f"ready-{kind}", logging.WARNING, "refused a READY for worker %s (pid %s): %s", wid, h.get("pid"),
                 why)
        self.sockets.disconnect(identity, f"registration refused: {why}")
        return False

    # -------------------------------------------------------------------------------------------- answers

    def on_reply(self, w: WorkerInfo, msg: wire.Message) -> None:
        rep = wire.parse_reply(msg, arrays=False)     # checked; its buffers go to the client untouched
        d = self.dispatcher
        job = d.inflight.get(rep.rid) if isinstance(rep.rid, int) else None
        if job is None or job.worker != w.id or job.kind != "request":
            self.counters["late_replies"] += 1    # a job already re-run elsewhere, or from before a restart
            return
        del d.inflight[job.id]
        w.inflight.discard(job.id)
        reason = rep.error.get("reason") if rep.error else None
        if rep.status == wire.STATUS_RETRYABLE:
            self._handed_back(w, job, reason, rep.message)
            return
        if rep.status == wire.STATUS_OK:
            w.completed += 1
        else:
            w.failed += 1
        now = time.monotonic()
        header = msg.header                 # this message's own map: the client's rid and the worker's id go in
        header["rid"] = job.client_rid
        header["worker"] = w.id
        if rep.metrics:
            # The broker's own stamps beside the worker's (this host's monotonic clock): where a pooled call's
            # hops and hand-offs go (benchmarks/overhead.py splits the legs with them).
            rep.metrics["broker_in"], rep.metrics["broker_out"], rep.metrics["broker_back"] = (
                job.arrived, job.dispatched, now)
        d.finish(job, wire.encode(Cmd.REPLY, header, *msg.frames))
        # After the reply is on its way: the metering is ours, the client need not wait for it.
        self.meter.answered(w.id, rep.status, reason, job.req.rows, job.req.tokens, now - job.arrived,
                            now - job.dispatched, rep.metrics)

    def _handed_back(self, w: WorkerInfo, job: Job, reason: str | None, message: str) -> None:
        """A retryable answer from `w`: `job` expired there, broke it, or must run elsewhere."""
        if reason == Reason.EXPIRED:
            self.dispatcher.expired(job, "worker")      # the worker skipped it: its caller had given up
        elif reason == Reason.WORKER_FAULT:
            # The worker failed running it (and is going down): that is a lost attempt, bounded by
            # max_attempts, so one poisonous request cannot take down worker after worker.
            self.dispatcher.lost(job, w, "the worker failed running it")
        else:
            # The worker is stopping (or could not take it): another worker runs it, up to max_bounces times.
            self.dispatcher.bounce(job, message or "workers keep handing this request back")

    def on_card(self, w: WorkerInfo, msg: wire.Message) -> None:
        rid = wire.get(msg.header, "rid", int, default=None)
        status = wire.get(msg.header, "status", str, default=wire.STATUS_OK)
        if status == wire.STATUS_OK:
            body = wire.body_of(msg)       # raises before anything changes: the worker is then confused
            if not isinstance(body, dict) or body.get("fingerprint") != w.fingerprint:
                raise wire.ProtocolError("body", "the card does not carry this worker's fingerprint")
            self.table.cards[w.fingerprint] = zmq.Frame(bytes(msg.frames[0]))
        d = self.dispatcher
        job = d.inflight.get(rid) if rid is not None else None
        if job is None or job.kind != "describe" or job.worker != w.id:
            return
        del d.inflight[job.id]
        w.inflight.discard(job.id)
        if status == wire.STATUS_OK and w.fingerprint == self.table.pool_fp:
            card = self.table.cards[w.fingerprint]
            self.sockets.to_client(job.envelope, wire.encode(Cmd.DESCRIBE, {
                "rid": job.client_rid, "status": wire.STATUS_OK, "fp": w.fingerprint, **self.table.capacity()},
                card), len(card))
            return
        if not d.requeue(job, lost=False):
            d.fail(job, wire.STATUS_RETRYABLE, "no worker could describe the model")

    # -------------------------------------------------------------------------------------------- liveness

    def watch(self, now: float) -> None:
        """Liveness of every worker (housekeeping)."""
        for w in list(self.table.workers.values()):
            self._watch(w, now)

    def _watch(self, w: WorkerInfo, now: float) -> None:
        """Liveness of one worker: silent, hung or unreachable means dead; otherwise a heartbeat when due."""
        if not w.state.connected:
            if w.state is WorkerState.DEAD and now - w.last_seen > FORGET_AFTER_S:
                # Drained and stopped workers stay listed: `restart-worker` must still find them.
                self.table.forget(w)
            return
        lost = self.dispatcher.worker_lost
        if now > w.expiry:
            lost(w, WorkerState.DEAD, f"missed heartbeats for {now - w.last_seen:.2f} s")
        elif self._holds_a_stuck_job(w, now):
            # Heartbeats come from the worker's I/O thread, so a hung device still looks alive:
            # judge it by its oldest job, re-send its work, and make it register again.
            lost(w, WorkerState.DEAD, f"held a request for over {self.cfg.job_timeout_s:g} s")
            self.sockets.disconnect(w.identity, Leave.HUNG)
        elif now - w.last_sent >= self.hb:
            drain = Leave.RESTART if w.drain_restart else Leave.DRAIN
            hdr = {"drain": drain} if w.state is WorkerState.DRAINING else {}
            if not self.sockets.to_worker(w, Cmd.HEARTBEAT, hdr):
                lost(w, WorkerState.DEAD, "unreachable")

    def _holds_a_stuck_job(self, w: WorkerInfo, now: float) -> bool:
        inflight = self.dispatcher.inflight
        return any(j in inflight and now - inflight[j].dispatched > self.cfg.job_timeout_s for j in w.inflight)
