"""The broker: routes requests from clients (frontend ROUTER) to workers (backend ROUTER).

What it owns:
- the worker table: id, device, model fingerprint, capacity, credit, liveness, state (`WorkerState`);
- the queue (bounded: a full queue answers "busy", retryable, with a retry-after hint, instead of growing);
- deadlines: a request carries its caller's time left (`budget_ms`); one still queued when it runs out is
  answered "expired" (or "no-worker" when no worker serves the model) and never dispatched, and a worker
  is handed only what is left, so it skips work whose caller has given up (docs/protocol.md, Deadlines);
- the in-flight table: a job sent to a worker that dies (missed heartbeats, vanished, or came back
  with a fresh READY) is sent to another worker, at most `max_attempts` times, never dropped silently;
- deduplication by (client id, request id): a retry of a request still queued or running waits for
  it (the reply goes to the retry's address), a retry of a finished one gets the cached reply
  (`broker.replies.ReplyCache`);
- heartbeats both ways (Paranoid Pirate): a worker silent for `liveness` intervals is dead; a
  message from a worker the broker does not know gets DISCONNECT, so the worker re-registers.

Words: a *request* is what a client sent; a *job* is the broker's record of one request (or describe
call) on its way to a worker, with a fresh id per dispatch. The broker speaks only the protocol package
(protocol/): no torch, no worker or client imports.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import signal
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from laya_pool.protocol import contract, logs, routing, wire
from laya_pool.protocol.contract import Leave, Reason, WorkerState
from laya_pool.protocol.wire import Cmd

from . import operator, security
from .metering import Meter
from .monitor import LogLimiter, SocketWatch
from .overload import DrainRate, retry_after
from .replies import ReplyCache, frames_bytes

log = logging.getLogger("laya-pool.broker")

FORGET_AFTER_S = 600.0          # dead entries stay in the status table this long


@dataclass
class BrokerConfig:
    frontend: str = contract.FRONTEND
    backend: str = contract.BACKEND
    heartbeat_ms: int = contract.HEARTBEAT_MS
    liveness: int = contract.LIVENESS
    queue_size: int = 1024
    queue_timeout_s: float = 30.0
    max_attempts: int = 3               # workers a request may be lost on before it is failed
    max_bounces: int = 32               # "worker stopping" hand-backs before the client is told to retry
    job_timeout_s: float = 300.0        # a worker holding one request longer than this is declared hung
    fingerprint: str | None = None      # the model this pool serves; None: the first worker's
    cache_size: int = 4096              # finished replies kept for retries
    cache_max_bytes: int = 256 << 20    # ... and the bytes they may hold together
    queue_max_bytes: int = 1 << 30      # request payloads waiting or running, together
    cache_ttl_s: float = 300.0
    cache_max_reply_bytes: int = 1 << 20
    max_frontend_bytes: int = contract.MAX_FRONTEND_BYTES  # ZMQ_MAXMSGSIZE (per frame): a larger one drops the client
    max_backend_bytes: int = contract.MAX_BACKEND_BYTES
    keys: str | None = None             # CURVE key directory (laya-pool keys); needed for a non-loopback bind
    insecure_backend: bool = False      # a tcp backend without keys (development only; logged)
    operator_secret: bool = True        # publish the operator secret (broker.operator) once bound
    max_restarts: int = 6               # restart-worker commands accepted per restart_window_s, pool-wide
    restart_window_s: float = 60.0
    client_hwm: int = 1000              # replies queued per client before more are dropped (it is not reading)
    poll_us: int = 0                    # after a message, poll without sleeping this long (0: always sleep)


@dataclass
class WorkerInfo:
    id: str
    identity: bytes
    data: bytes | None = None           # the worker's data socket: its replies come from there
    data_requests: bool = False         # ... and its requests go there (once it is connected)
    direct: str | None = None           # where clients may send it requests themselves (loopback without keys)
    direct_key: str = ""                # ... and that socket's CURVE public key (z85), with keys
    host: str = "?"
    device: str = "?"
    fingerprint: str = ""
    capacity: dict[str, int] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)
    credit: int = 1
    pid: int | None = None
    mode: str | None = None
    generation: int = 0
    state: WorkerState = WorkerState.READY
    inflight: set[int] = field(default_factory=set)
    expiry: float = 0.0
    last_sent: float = 0.0
    last_seen: float = 0.0
    last_dispatch: float = 0.0
    since: float = 0.0
    registrations: int = 0
    completed: int = 0
    failed: int = 0
    lost: int = 0
    drain_restart: bool = False
    restart_requested: bool = False     # restart-worker on a worker that is down: the supervisor starts it
    stats: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The capacity as three ints, read once: every request is measured against it twice (refuse, pick).
        c = self.capacity
        self._bounds = (c.get("max_tokens", 1 << 62), c.get("max_rows", 1 << 62), c.get("max_markers", 1 << 62))

    def fits(self, req: wire.RequestHead) -> bool:
        tokens, rows, markers = self._bounds
        return req.tokens <= tokens and req.rows <= rows and req.n_markers <= markers

    def row(self, now: float) -> dict[str, Any]:
        return {"id": self.id, "device": self.device, "state": self.state, "pid": self.pid,
                "fingerprint": self.fingerprint, "mode": self.mode, "capacity": self.capacity,
                "credit": self.credit, "inflight": len(self.inflight), "completed": self.completed,
                "failed": self.failed, "lost": self.lost, "registrations": self.registrations,
                "generation": self.generation, "restart_requested": self.restart_requested, "direct": self.direct,
                "up_s": round(now - self.since, 3),
                "last_seen_ms": round((now - self.last_seen) * 1e3, 1), "stats": self.stats}


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


class Broker:
    def __init__(self, cfg: BrokerConfig, ctx: zmq.Context | None = None):
        self.cfg = cfg
        security.check_endpoints(cfg.frontend, cfg.backend, cfg.keys, cfg.insecure_backend)
        self.ctx = ctx or zmq.Context.instance()
        self.auth = None
        self.say = LogLimiter(log)
        self.frontend = self._router(cfg.frontend, cfg.max_frontend_bytes, handover=False, role="clients",
                                     hwm=cfg.client_hwm)
        self.backend = self._router(cfg.backend, cfg.max_backend_bytes, handover=True, role="workers")
        self._send_frontend, self._send_backend = _frame_sender(self.frontend), _frame_sender(self.backend)
        self.watches = [SocketWatch(self.frontend, "frontend", self.say),
                        SocketWatch(self.backend, "backend", self.say)]
        self.operator_keys = operator.operator_keys(cfg.keys)
        self.peer_user: str | None = None       # the CURVE key of the frontend message being handled
        self.restarts = operator.RestartLimit(cfg.max_restarts, cfg.restart_window_s)
        self.op_token, self.op_path = None, None
        if cfg.operator_secret:     # after binding: a broker that could not bind never replaces a pool's secret
            self.op_token, self.op_path = operator.publish_secret(cfg.frontend)
        self.hb = cfg.heartbeat_ms / 1000.0
        self.workers: dict[str, WorkerInfo] = {}
        self.by_identity: dict[bytes, str] = {}
        self.queue: collections.deque[Job] = collections.deque()
        # Describe jobs in the queue, counted: dispatch asks "any describe waiting?" on every event, and a
        # scan of a deep queue there cost more than the rest of the loop under load (scripts/broker_rate.py).
        self.describes_queued = 0
        self.inflight: dict[int, Job] = {}
        self.by_key: dict[tuple[str, Any], Job] = {}     # requests queued or running, by dedup key
        self.replies = ReplyCache(cfg.cache_size, cfg.cache_max_bytes, cfg.cache_ttl_s, cfg.cache_max_reply_bytes)
        self.queue_bytes = 0
        self.cards: dict[str, zmq.Frame] = {}   # fingerprint -> the card body frame, one buffer shared by all sends
        self.pool_fp: str | None = cfg.fingerprint or None
        self.reload: dict[str, str] | None = None     # the latest `laya-pool reload`, for the supervisor (status)
        self.next_job = int.from_bytes(os.urandom(6), "little") << 8   # a restarted broker never reuses ids
        self.started = time.monotonic()
        self.stopping = False
        self.last_housekeeping = 0.0
        self.counters = collections.Counter()
        self.meter = Meter()                    # outcomes, per-worker work and timings (broker/metering.py)
        self.drain = DrainRate()                # requests leaving the queue per second: the busy hint's basis
        self.choose = routing.policy()          # the pool's routing policy, as every client's (protocol/routing.py)

    # -------------------------------------------------------------------------------------------- sockets

    def _router(self, endpoint: str, max_bytes: int, handover: bool, role: str, hwm: int = 100_000) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if handover:
            s.setsockopt(zmq.ROUTER_HANDOVER, 1)
        s.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, hwm)     # per peer: a peer that never reads cannot grow the broker past it
        s.setsockopt(zmq.RCVHWM, 100_000)
        if self.cfg.keys:
            if self.auth is None:
                self.auth = security.start_authenticator(self.ctx, self.cfg.keys)
            # Each socket authenticates its own kind of peer: a client key cannot register as a worker.
            security.curve_server(s, self.cfg.keys, role)
        if endpoint.startswith("ipc://"):
            os.makedirs(os.path.dirname(endpoint[len("ipc://"):]) or ".", exist_ok=True)
            security.ipc_free(endpoint)     # ZeroMQ would unlink a live pool's socket and take its place
        s.bind(endpoint)
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://"):], 0o600)   # only this user's processes may connect
        return s

    def _receive_all(self, sock: zmq.Socket, handler: Callable[[list[bytes]], None], limit: int = 1000) -> None:
        """Handle what `sock` holds, at most `limit` messages, so one side cannot starve the other."""
        # Per message only the receive and the handler (this loop runs four times per routed request): the
        # receiver is chosen once, and the guard is inline (a bug met by one message must not take the pool's
        # routing table down with it).
        recv = self._recv_with_user if sock is self.frontend and self.operator_keys else wire.recv_frames
        for _ in range(limit):
            try:
                frames = recv(sock)
            except zmq.Again:
                return
            try:
                handler(frames)
            except Exception:  # noqa: BLE001
                self._internal_error(handler, frames)

    def _recv_with_user(self, sock: zmq.Socket) -> list[bytes]:
        # Under CURVE, who sent it (the authenticated key) decides whether it may drain a worker.
        first = sock.recv(zmq.NOBLOCK, copy=False)
        try:
            self.peer_user = first.get("User-Id")
        except zmq.ZMQError:
            self.peer_user = None
        return [first.bytes, *sock.recv_multipart()] if first.more else [first.bytes]

    def _send(self, sock: zmq.Socket, frames: list[Any]) -> bool:
        """One message without waiting; False when its peer is gone or its queue is full."""
        send = self._send_frontend if sock is self.frontend else self._send_backend
        try:
            # Frame by frame with plain-int flags, through pyzmq's compiled send (`_frame_sender`). Only the first
            # frame can fail: once it is taken, ZeroMQ takes the rest.
            for f in frames[:-1]:
                send(f, _MORE)
            send(frames[-1], wire.DONTWAIT)
            return True
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise

    def _to_client(self, envelope: list[bytes], frames: list[Any]) -> None:
        if not self._send(self.frontend, envelope + frames):
            # Gone, or not reading: its queue (client_hwm replies) is full. Dropped, so memory stays bounded.
            self.counters["client_gone"] += 1
            self.say("client-hwm", logging.WARNING, "dropped a reply: the client is gone or not reading its replies "
                     "(%d queued at most per client; --client-hwm)", self.cfg.client_hwm)

    def _client_error(self, envelope: list[bytes], rid: Any, status: str, message: str, *, field: str | None = None,
                      row: int | None = None, cmd: Cmd = Cmd.REPLY, reason: str | None = None,
                      retry_after: float | None = None, like: list[Any] | None = None) -> None:
        """`like`: the undecodable message this answers (a LAYA2 peer's gets its answer in LAYA2's layout)."""
        self.counters["errors_" + status] += 1
        if cmd == Cmd.REPLY:
            self.meter.refused(status, reason)
        reply = wire.encode_error(rid, status, message, field=field, row=row, cmd=cmd, reason=reason,
                                  retry_after=retry_after)
        self._to_client(envelope, reply if like is None else wire.in_kind(like, reply))

    def _to_worker(self, w: WorkerInfo, cmd: Cmd, header: dict, *frames: Any) -> bool:
        ok = self._send(self.backend, [w.identity, *wire.encode(cmd, header, *frames)])
        if ok:
            w.last_sent = time.monotonic()
        return ok

    def _to_data(self, w: WorkerInfo, frames: list[Any]) -> bool:
        """A request to the worker's data thread, or to its control socket while the data socket is not connected
        (ROUTER_MANDATORY refuses an unknown peer at the first frame, so nothing was sent; the worker's I/O thread
        hands what it gets there to the data thread)."""
        if w.data_requests and self._send(self.backend, [w.data, *frames]):
            return True     # not `last_sent`: the worker's I/O thread hears the broker on its control socket only
        self.counters["routed_to_control"] += w.data_requests
        ok = self._send(self.backend, [w.identity, *frames])
        if ok:
            w.last_sent = time.monotonic()
        return ok

    # -------------------------------------------------------------------------------------------- loop

    def run(self) -> int:
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        for watch in self.watches:
            poller.register(watch.sock, zmq.POLLIN)
        log.info("broker %d: frontend %s, backend %s, heartbeat %d ms x %d", os.getpid(), self.cfg.frontend,
                 self.cfg.backend, self.cfg.heartbeat_ms, self.cfg.liveness)
        awake_until = 0.0                 # --poll-us: poll without sleeping until then
        while not self.stopping:
            timeout = max(1, int(self.hb * 1000 / 2))
            if self.queue:
                # Queued requests have deadlines: look at them every housekeeping period, even when idle.
                timeout = min(timeout, max(1, int(self._housekeeping_s() * 1000)))
            if self.cfg.poll_us and time.monotonic() < awake_until:
                timeout = 0
            events = dict(poller.poll(timeout))
            if events and self.cfg.poll_us:
                awake_until = time.monotonic() + self.cfg.poll_us / 1e6
            # Workers first: replies free credit for the requests waiting behind them.
            if events.get(self.backend):
                self._receive_all(self.backend, self.on_backend)
            if events.get(self.frontend):
                self._receive_all(self.frontend, self.on_frontend)
            for watch in self.watches:
                if events.get(watch.sock):
                    watch.handle()
            self.tick()
        self.shutdown()
        return 0

    def _internal_error(self, handler: Callable[[list[bytes]], None], frames: list[bytes]) -> None:
        """`handler` raised on `frames` (a bug): logged and counted; a client is told to retry."""
        self.counters["internal_errors"] += 1
        log.exception("broker: internal error while handling a message")
        if handler == self.on_frontend:
            cut = 2 if len(frames) > 1 and frames[1] == b"" else 1
            with contextlib.suppress(Exception):
                self._client_error(frames[:cut], wire.rid_of(frames[cut:]) if len(frames) > cut else None,
                                   wire.STATUS_RETRYABLE, "internal broker error", reason=Reason.INTERNAL)

    def shutdown(self) -> None:
        for job in list(self.queue) + list(self.inflight.values()):
            self._fail(job, wire.STATUS_RETRYABLE, "the broker is shutting down", reason=Reason.SHUTDOWN)
        self.queue.clear()
        self.describes_queued = 0
        self.inflight.clear()
        if self.auth is not None:
            wire.stop_authenticator(self.auth)     # (pyzmq's own stop waits forever on a handler that died)
        if self.op_path is not None:
            operator.remove_secret(self.op_path, self.op_token)
        for watch in self.watches:
            watch.close()
        self.frontend.close(0)
        self.backend.close(0)

    def tick(self) -> None:
        """Between messages: dispatch, and every few tens of milliseconds the housekeeping first."""
        now = time.monotonic()
        if now - self.last_housekeeping >= self._housekeeping_s():
            self.last_housekeeping = now
            for w in list(self.workers.values()):
                self._watch(w, now)
            self._expire_queue(now)
            self.replies.expire(now)
        self.dispatch()

    def _housekeeping_s(self) -> float:
        return min(0.05, self.hb / 4)

    def _watch(self, w: WorkerInfo, now: float) -> None:
        """Liveness of one worker: silent, hung or unreachable means dead; otherwise a heartbeat when due."""
        if not w.state.connected:
            if w.state is WorkerState.DEAD and now - w.last_seen > FORGET_AFTER_S:
                # Drained and stopped workers stay listed: `restart-worker` must still find them.
                self.workers.pop(w.id, None)
                self.by_identity.pop(w.identity, None)
                self.by_identity.pop(w.data, None)
            return
        if now > w.expiry:
            self._worker_lost(w, WorkerState.DEAD, f"missed heartbeats for {now - w.last_seen:.2f} s")
        elif self._holds_a_stuck_job(w, now):
            # Heartbeats come from the worker's I/O thread, so a hung device still looks alive:
            # judge it by its oldest job, re-send its work, and make it register again.
            self._worker_lost(w, WorkerState.DEAD, f"held a request for over {self.cfg.job_timeout_s:g} s")
            self._send(self.backend, [w.identity, *wire.encode(Cmd.DISCONNECT, {"reason": Leave.HUNG})])
        elif now - w.last_sent >= self.hb:
            drain = Leave.RESTART if w.drain_restart else Leave.DRAIN
            hdr = {"drain": drain} if w.state is WorkerState.DRAINING else {}
            if not self._to_worker(w, Cmd.HEARTBEAT, hdr):
                self._worker_lost(w, WorkerState.DEAD, "unreachable")

    def _holds_a_stuck_job(self, w: WorkerInfo, now: float) -> bool:
        return any(j in self.inflight and now - self.inflight[j].dispatched > self.cfg.job_timeout_s
                   for j in w.inflight)

    def _expire_queue(self, now: float) -> None:
        """Take out of the queue what waited longer than `queue_timeout_s` for a worker (failed, retryable) and
        what its caller has given up on (its deadline passed: never dispatched, counted, answered with why)."""
        timeout = self.cfg.queue_timeout_s
        if not any(now - j.enqueued > timeout or (j.expires is not None and now >= j.expires) for j in self.queue):
            return
        kept: collections.deque[Job] = collections.deque()
        for job in self.queue:
            if job.expires is not None and now >= job.expires:
                self.describes_queued -= job.kind == "describe"
                self._expired(job, "queue")
            elif now - job.enqueued > timeout:
                self.describes_queued -= job.kind == "describe"
                self._fail(job, wire.STATUS_RETRYABLE, f"no worker took this request within {timeout:g} s",
                           reason=Reason.QUEUE_TIMEOUT)
            else:
                kept.append(job)
        self.queue = kept

    def _expired(self, job: Job, where: str) -> None:
        """`job`'s caller has given up (`where`: it ran out of time in the "queue", or a "worker" skipped it).
        Counted; the answer says why, in case the caller is still listening (it stamps its budget a little
        short of its own deadline so that it can hear this): no worker serving the model, or just no time."""
        self.counters["expired"] += 1
        self.meter.expired(where)
        if where == "queue" and not self._serving():
            self._fail(job, wire.STATUS_RETRYABLE, "no worker is serving the model: the request waited in the queue "
                       "until its deadline", reason=Reason.NO_WORKER)
            return
        place = "in the broker's queue" if where == "queue" else "inside its worker"
        self._fail(job, wire.STATUS_RETRYABLE, f"the request's deadline passed while it waited {place}",
                   reason=Reason.EXPIRED)

    # -------------------------------------------------------------------------------------------- clients

    def on_frontend(self, frames: list[bytes]) -> None:
        self.counters["frontend_messages"] += 1
        # DEALER clients send [identity, proto, ...]; REQ clients add an empty delimiter.
        cut = 2 if len(frames) > 1 and frames[1] == b"" else 1
        envelope, body = frames[:cut], frames[cut:]
        try:
            msg = wire.decode(body)
        except wire.ProtocolError as e:
            self.counters["malformed"] += 1
            self._client_error(envelope, wire.rid_of(body) if body else None, wire.STATUS_FINAL,
                               str(e), field=e.field, like=body)
            return
        try:
            if msg.cmd == Cmd.REQUEST:
                self.on_request(envelope, msg)
            elif msg.cmd == Cmd.DESCRIBE:
                self.on_describe(envelope, msg)
            elif msg.cmd == Cmd.STATUS:
                rid = wire.get(msg.header, "rid", (int, str), default=None)
                self._to_client(envelope, wire.encode_body_reply(Cmd.STATUS, rid, self.status()))
            elif msg.cmd == Cmd.DRAIN:
                self.on_drain(envelope, msg)
            elif msg.cmd == Cmd.RELOAD:
                self.on_reload(envelope, msg)
            elif msg.cmd == Cmd.HEARTBEAT:
                routes = {"routes": self.routes()} if msg.header.get("routes") is True else {}
                self._to_client(envelope, wire.encode(Cmd.HEARTBEAT, {"rid": msg.header.get("rid"),
                                                                       "status": wire.STATUS_OK, **routes}))
            else:
                raise wire.ProtocolError("command", f"{msg.cmd.name} is not a client command")
        except wire.ProtocolError as e:
            self.counters["malformed"] += 1
            self._client_error(envelope, wire.rid_of(body), wire.STATUS_FINAL, str(e), field=e.field, cmd=msg.cmd
                               if msg.cmd in (Cmd.STATUS, Cmd.DRAIN, Cmd.DESCRIBE, Cmd.RELOAD) else Cmd.REPLY)

    def on_request(self, envelope: list[bytes], msg: wire.Message) -> None:
        # The header and the buffers' sizes are checked; the buffers themselves go to the worker untouched.
        req = wire.parse_request_head(msg, need_cid=True)   # dedup needs an id that survives reconnects
        self.counters["requests"] += 1
        key = (req.cid, req.rid)
        if self._answered_or_joined(key, envelope, req.budget_ms):
            return
        if req.worker is not None and not self._target_ready(req, envelope):
            return
        self._check_capacity(req)
        size = frames_bytes(msg.frames)
        if len(self.queue) >= self.cfg.queue_size or self.queue_bytes + size > self.cfg.queue_max_bytes:
            self._busy(envelope, req.rid, Cmd.REPLY)
            return
        now = time.monotonic()
        job = Job(self._job_id(), "request", key, envelope, req.rid, req=req, payload=msg.frames, target=req.worker,
                  enqueued=now, nbytes=size, arrived=now, expires=_expiry(now, req.budget_ms))
        self.by_key[key] = job
        self.queue_bytes += size
        self.queue.append(job)
        self.dispatch()

    def _busy(self, envelope: list[bytes], rid: Any, cmd: Cmd) -> None:
        """Turn a request away (the queue is full) with the time the queue needs to drain as the retry-after."""
        self.counters["busy"] += 1
        wait = retry_after(len(self.queue), self.drain.rate(time.monotonic()))
        self._client_error(envelope, rid, wire.STATUS_RETRYABLE, f"the pool is busy ({len(self.queue)} requests, "
                           f"{self.queue_bytes} B queued); retry after {wait:.2f} s", cmd=cmd, reason=Reason.BUSY,
                           retry_after=wait)

    def _answered_or_joined(self, key: tuple[str, Any], envelope: list[bytes], budget_ms: int | None = None) -> bool:
        """A retry: a finished request is answered from the cache; a queued or running one is joined (its
        reply goes to the latest attempt's address, its deadline is the latest attempt's). Either way it does
        not run again."""
        cached = self.replies.get(key)
        if cached is not None:
            self.counters["cache_hits"] += 1
            self._to_client(envelope, cached)
            return True
        job = self.by_key.get(key)
        if job is not None:
            self.counters["retries_joined"] += 1
            job.envelope = envelope
            if budget_ms is not None:
                job.expires = _expiry(time.monotonic(), budget_ms)
            return True
        return False

    def _target_ready(self, req: wire.RequestHead, envelope: list[bytes]) -> bool:
        """A request that names its worker: final if there is no such worker, retryable while it is not ready."""
        w = self.workers.get(req.worker)
        if w is None:
            raise wire.ProtocolError("worker", f"no worker {req.worker!r} in this pool")
        if not w.state.dispatchable:   # a named mismatched worker is reachable: diagnostics
            self._client_error(envelope, req.rid, wire.STATUS_RETRYABLE, f"worker {req.worker!r} is {w.state}",
                               reason=Reason.WORKER_UNAVAILABLE)
            return False
        return True

    def _capacity(self) -> dict[str, Any]:
        """`{"capacity": {...}}` for a describe reply: the largest request a ready worker takes (the worker
        `_check_capacity` measures against), so a client refuses a larger one before sending it."""
        ready = self._serving()
        if not ready:
            return {}
        c = max(ready, key=lambda w: w.capacity.get("max_tokens", 0)).capacity
        return {"capacity": {k: c[k] for k in ("max_tokens", "max_rows", "max_markers") if k in c}}

    def _check_capacity(self, req: wire.RequestHead) -> None:
        """A request larger than every ready worker can hold is refused now (final), naming what is too large."""
        if self._fits_a_ready_worker(req):
            return
        ready = self._serving()
        c = max(ready, key=lambda w: w.capacity.get("max_tokens", 0)).capacity
        for name, have, cap in (("ids", req.tokens, "max_tokens"), ("lengths", req.rows, "max_rows"),
                                ("markers", req.n_markers, "max_markers")):
            if have > c.get(cap, 1 << 62):
                raise wire.ProtocolError(name, f"{have} exceeds every worker's capacity ({cap} {c[cap]})")
        raise wire.ProtocolError("ids", "the request fits no worker's capacity")

    def _fits_a_ready_worker(self, req: wire.RequestHead) -> bool:
        """True when a ready worker of the pool's model can hold `req`, or when there is none to judge by."""
        ready = False
        for w in self.workers.values():
            if w.state is WorkerState.READY and w.fingerprint == self.pool_fp:
                if w.fits(req):
                    return True
                ready = True
        return not ready

    def on_describe(self, envelope: list[bytes], msg: wire.Message) -> None:
        rid = wire.get(msg.header, "rid", (int, str), default=None)
        if self.pool_fp in self.cards:
            self._to_client(envelope, wire.encode(Cmd.DESCRIBE, {"rid": rid, "status": wire.STATUS_OK,
                                                                 "fp": self.pool_fp, **self._capacity()},
                                                  self.cards[self.pool_fp]))
            return
        if len(self.queue) >= self.cfg.queue_size:
            self._busy(envelope, rid, Cmd.DESCRIBE)
            return
        job = Job(self._job_id(), "describe", None, envelope, rid, enqueued=time.monotonic())
        job.expires = _expiry(job.enqueued, wire.budget_of(msg.header))
        self.queue.append(job)
        self.describes_queued += 1
        self.dispatch()

    def on_drain(self, envelope: list[bytes], msg: wire.Message) -> None:
        rid = wire.get(msg.header, "rid", (int, str), default=None)
        wid = wire.get(msg.header, "worker", str)
        restart = wire.get(msg.header, "restart", bool, default=False)
        if not self._operator_may(envelope, msg, rid):
            return
        w = self.workers.get(wid)
        if w is None:
            raise wire.ProtocolError("worker", f"no worker {wid!r} in this pool")
        if restart and not self._restart_allowed(envelope, rid, w):
            return
        if not w.state.connected and restart:
            # It is down (drained, stopped, dead): the supervisor sees this flag in the status and starts it.
            w.restart_requested = True
            self._to_client(envelope, wire.encode_body_reply(Cmd.DRAIN, rid, {
                "worker": wid, "state": w.state, "restart": True, "restart_requested": True, "inflight": 0,
                "registrations": w.registrations, "pid": w.pid}))
            return
        if not w.state.connected:
            self._client_error(envelope, rid, wire.STATUS_FINAL, f"worker {wid!r} is {w.state}", field="worker",
                               cmd=Cmd.DRAIN)
            return
        w.state, w.drain_restart = WorkerState.DRAINING, restart
        self._to_worker(w, Cmd.DRAIN, {"restart": restart})
        log.info("worker %s: draining%s (%d in flight)", wid, " for a restart" if restart else "", len(w.inflight))
        self._to_client(envelope, wire.encode_body_reply(Cmd.DRAIN, rid, {
            "worker": wid, "state": w.state, "restart": restart, "inflight": len(w.inflight),
            "registrations": w.registrations, "pid": w.pid}))
        self.dispatch()

    def on_reload(self, envelope: list[bytes], msg: wire.Message) -> None:
        """`laya-pool reload`: remember the new checkpoint for the supervisor (it reads `reload` in the status
        and restarts the workers on it one at a time) and serve its fingerprint once enough workers have it."""
        rid = wire.get(msg.header, "rid", (int, str), default=None)
        if not self._operator_may(envelope, msg, rid, Cmd.RELOAD):
            return
        model = wire.get(msg.header, "model", str)
        fp = wire.get(msg.header, "fingerprint", str)
        if not model.startswith("/") or len(model) > 4096:
            raise wire.ProtocolError("model", "an absolute path of the checkpoint directory")
        if len(fp) != 64 or any(c not in "0123456789abcdef" for c in fp):
            raise wire.ProtocolError("fingerprint", "the checkpoint's sha256 (64 hex digits)")
        self.reload = {"id": wire.get(msg.header, "id", str, default=str(rid))[:64], "model": model,
                       "fingerprint": fp, "previous": self.pool_fp or ""}
        log.info("reload requested: model %s (%s), serving %s until enough workers have it", fp[:12], model,
                 (self.pool_fp or "?")[:12])
        self._to_client(envelope, wire.encode_body_reply(Cmd.RELOAD, rid, {"reload": self.reload}))
        self._maybe_switch_model()

    def _maybe_switch_model(self) -> None:
        """During a reload, serve the new model once at least as many ready workers have it as have the old:
        a client whose answer comes from the new model fetches its card again (by the fingerprint), and
        the workers still on the old model wait, idle, for their turn."""
        r = self.reload
        if r is None or r["fingerprint"] == self.pool_fp:
            return
        ready = [w for w in self.workers.values() if w.state in (WorkerState.READY, WorkerState.MISMATCH)]
        new = sum(w.fingerprint == r["fingerprint"] for w in ready)
        old = sum(w.fingerprint == self.pool_fp for w in ready)
        if new == 0 or new < old:
            return
        log.info("serving model %s from now on (%d workers have it, %d still have %s)", r["fingerprint"][:12], new,
                 old, (self.pool_fp or "?")[:12])
        self.pool_fp = self.cfg.fingerprint = r["fingerprint"]
        for w in ready:
            w.state = WorkerState.READY if w.fingerprint == self.pool_fp else WorkerState.MISMATCH
        self.dispatch()

    def _operator_may(self, envelope: list[bytes], msg: wire.Message, rid: Any, cmd: Cmd = Cmd.DRAIN) -> bool:
        """A command that changes the pool: only from a peer with the operator secret or the operator key."""
        if operator.token_matches(msg.header.get("op"), self.op_token) or (
                self.peer_user is not None and self.peer_user in self.operator_keys):
            return True
        self.counters["not_allowed"] += 1
        self.say("not-allowed", logging.WARNING, "refused a drain/restart from a peer without the operator "
                 "credential (a plain client): the pool keeps serving")
        how = (f"run `laya-pool drain` / `restart-worker` as the user who started the pool (it reads the secret in "
               f"{operator.runtime_dir()})")
        if self.cfg.keys:
            how += ", or connect with the operator key (keys=DIR with operator.key_secret)"
        self._client_error(envelope, rid, wire.STATUS_FINAL, f"not allowed: drain, restart and reload need the "
                           f"pool's operator credential; {how}", field="op", cmd=cmd, reason=Reason.NOT_ALLOWED)
        return False

    def _restart_allowed(self, envelope: list[bytes], rid: Any, w: WorkerInfo) -> bool:
        """Restarts reload a model: at most `max_restarts` per `restart_window_s`, pool-wide. A repeat for a
        worker already on its way back is not a new restart and costs nothing."""
        if w.restart_requested or w.state is WorkerState.RESTARTING or (
                w.state is WorkerState.DRAINING and w.drain_restart):
            return True
        wait = self.restarts.allow(time.monotonic())
        if wait <= 0:
            return True
        self.counters["restarts_refused"] += 1
        self.say("restart-limit", logging.WARNING, "refused a restart of worker %s: %d restarts in %g s already",
                 w.id, self.cfg.max_restarts, self.cfg.restart_window_s)
        self._client_error(envelope, rid, wire.STATUS_FINAL, f"restart refused: at most {self.cfg.max_restarts} "
                           f"restarts per {self.cfg.restart_window_s:g} s (--max-restarts, --restart-window); "
                           f"try again in {wait:.0f} s", field="restart", cmd=Cmd.DRAIN, reason=Reason.RATE_LIMITED)
        return False

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"workers": [w.row(now) for w in sorted(self.workers.values(), key=lambda w: _natural(w.id))],
                "broker": {"pid": os.getpid(), "frontend": self.cfg.frontend, "backend": self.cfg.backend,
                           "fingerprint": self.pool_fp, "reload": self.reload, "uptime_s": round(now - self.started, 3),
                           "heartbeat_ms": self.cfg.heartbeat_ms, "liveness": self.cfg.liveness,
                           "queue": len(self.queue), "queue_size": self.cfg.queue_size,
                           "drain_per_s": round(self.drain.rate(now), 3),
                           "queue_bytes": self.queue_bytes, "cached_reply_bytes": self.replies.bytes,
                           "inflight": len(self.inflight), "cached_replies": len(self.replies),
                           "counters": dict(self.counters)},
                "meter": self.meter.snapshot()}

    # -------------------------------------------------------------------------------------------- workers

    def on_backend(self, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        now = time.monotonic()
        try:
            msg = wire.decode(body)
        except wire.ProtocolError as e:
            self.counters["worker_malformed"] += 1
            log.warning("worker %r sent a malformed message (%s)", identity, e)
            self._confused(identity, f"malformed message: {e}", like=body)
            return
        wid = self.by_identity.get(identity)
        w = self.workers.get(wid) if wid is not None else None
        if msg.cmd == Cmd.READY:
            try:
                self.on_ready(identity, msg, now)
            except wire.ProtocolError as e:
                log.warning("worker %r sent a bad READY (%s)", identity, e)
                self._send(self.backend, [identity, *wire.encode(Cmd.DISCONNECT, {"reason": f"bad READY: {e}"})])
            return
        if w is None or not w.state.connected:
            # A worker we do not know (we restarted, or declared it dead): make it register again.
            if msg.cmd != Cmd.DISCONNECT:
                self._send(self.backend, [identity, *wire.encode(Cmd.DISCONNECT, {"reason": Leave.NOT_REGISTERED})])
            return
        w.last_seen, w.expiry = now, now + self.hb * self.cfg.liveness
        try:
            self._on_worker_message(w, msg)
        except wire.ProtocolError as e:
            self.counters["worker_malformed"] += 1
            log.warning("worker %s sent a bad %s (%s)", w.id, msg.cmd.name, e)
            self._confused(identity, str(e))
        self.dispatch()

    def _on_worker_message(self, w: WorkerInfo, msg: wire.Message) -> None:
        """A message from a registered worker (READY is handled before: it is how a worker gets here)."""
        if msg.cmd == Cmd.HEARTBEAT:
            stats = wire.get(msg.header, "stats", dict, default=None)
            if stats is not None:
                w.stats = stats
        elif msg.cmd == Cmd.REPLY:
            self.on_worker_reply(w, msg)
        elif msg.cmd == Cmd.DESCRIBE:
            self.on_worker_card(w, msg)
        elif msg.cmd == Cmd.DRAIN:
            # The worker drains on its own (SIGTERM): dispatch nothing more to it.
            if w.state is WorkerState.READY:
                w.state = WorkerState.DRAINING
                log.info("worker %s: draining (%s)", w.id, msg.header.get("reason", "its own decision"))
                self._maybe_switch_model()
        elif msg.cmd == Cmd.DISCONNECT:
            reason = wire.get(msg.header, "reason", str, default=Leave.SHUTDOWN)
            state = {Leave.DRAIN: WorkerState.DRAINED, Leave.RESTART: WorkerState.RESTARTING}.get(
                reason, WorkerState.STOPPED)
            # A worker that leaves in good order answered all it read; a request still counted here was on its way
            # to it (its data socket is not ordered with its control socket): a hand-back, not a lost attempt.
            self._worker_lost(w, state, f"left ({reason})",
                              lost=reason not in (Leave.DRAIN, Leave.RESTART, Leave.SHUTDOWN))
        else:
            raise wire.ProtocolError("command", f"{msg.cmd.name} is not a worker command")

    def _confused(self, identity: bytes, why: str, like: list[bytes] | None = None) -> None:
        """`like`: the undecodable message this answers (a LAYA2 worker gets its DISCONNECT in LAYA2's layout, so it
        logs the reason, naming `version`, instead of failing on the framing)."""
        wid = self.by_identity.get(identity)
        if wid is not None and wid in self.workers:
            self._worker_lost(self.workers[wid], WorkerState.DEAD, why)
        leave = wire.encode(Cmd.DISCONNECT, {"reason": why[:200]})
        self._send(self.backend, [identity, *(leave if like is None else wire.in_kind(like, leave))])

    def on_ready(self, identity: bytes, msg: wire.Message, now: float) -> None:
        h = msg.header
        wid = wire.get(h, "id", str)
        if not wid or identity != wid.encode():
            raise wire.ProtocolError("id", f"the worker id {wid!r} must equal its socket identity {identity!r}")
        if "/" in wid:
            raise wire.ProtocolError("id", f"a worker id has no '/' (it names the worker's data socket): {wid!r}")
        cap = wire.get(h, "capacity", dict)
        for k in ("max_tokens", "max_rows", "max_markers"):
            wire.get(cap, k, int, what="capacity")
        fp = wire.get(h, "fingerprint", str)
        data = wire.get(h, "data", str, default=None)
        if data is not None and data != f"{wid}/data":
            raise wire.ProtocolError("data", f"a worker's data socket is {wid + '/data'!r}, not {data!r}")
        direct = wire.get(h, "direct", str, default=None)
        direct_key = wire.get(h, "direct_key", str, default=None)
        if direct_key is not None and not wire.is_curve_key(direct_key):
            raise wire.ProtocolError("direct_key", "a CURVE public key in z85 (40 characters)")
        if direct is not None and self.cfg.keys and direct_key is None:
            raise wire.ProtocolError("direct_key", "a pool with keys needs the direct socket's CURVE key")
        if direct is not None and not wire.is_loopback(direct) and direct_key is None:
            raise wire.ProtocolError("direct", f"a direct socket beyond loopback needs CURVE (direct_key): {direct!r}")
        old = self.workers.get(wid)
        registrations, kept = 0, {}
        if old is not None:
            registrations = old.registrations
            kept = {"completed": old.completed, "failed": old.failed, "lost": old.lost}   # a worker's history
            if old.state.live and old.inflight:
                # The same id registered again: the old process (and its work) is gone.
                self._requeue_from(old, "re-registered")
            self.by_identity.pop(old.data, None)
        w = WorkerInfo(id=wid, identity=identity, data=None if data is None else data.encode(),
                       data_requests=data is not None and wire.get(h, "data_requests", bool, default=False),
                       direct=direct, direct_key=direct_key or "", host=wire.get(h, "host", str, default="?"),
                       device=wire.get(h, "device", str, default="?"), fingerprint=fp,
                       capacity={k: int(v) for k, v in cap.items() if isinstance(v, int)},
                       limits={k: int(v) for k, v in wire.get(h, "limits", dict, default={}).items()
                               if isinstance(v, int)},
                       credit=max(1, wire.get(h, "credit", int, default=1)),
                       pid=wire.get(h, "pid", int, default=None), mode=wire.get(h, "mode", str, default=None),
                       generation=wire.get(h, "generation", int, default=0), expiry=now + self.hb * self.cfg.liveness,
                       last_seen=now, since=now, registrations=registrations + 1, **kept)
        live_fps = {x.fingerprint for x in self.workers.values() if x.state.live and x.id != wid}
        # A pool started for one model (`--fingerprint`, which `laya-pool up` passes) never changes model;
        # a bare broker follows the workers it has.
        if not self.cfg.fingerprint and (self.pool_fp is None or not live_fps or self.pool_fp not in live_fps):
            self.pool_fp = fp
        if fp != self.pool_fp and self.reload is not None and fp == self.reload["fingerprint"]:
            w.state = WorkerState.MISMATCH      # until _maybe_switch_model serves the new model
            log.info("worker %s has the model of the reload (%s); the pool serves %s until enough workers have it",
                     wid, fp[:12], self.pool_fp[:12])
        elif fp != self.pool_fp:
            w.state = WorkerState.MISMATCH
            log.error("worker %s serves model %s but the pool serves %s: not dispatching to it", wid, fp[:12],
                      self.pool_fp[:12])
        self.workers[wid] = w
        self.by_identity[identity] = wid
        if w.data is not None:
            self.by_identity[w.data] = wid
        self._to_worker(w, Cmd.HEARTBEAT, {})
        log.info("worker %s ready: %s pid %s, credit %d, fingerprint %s (registration %d)", wid, w.device, w.pid,
                 w.credit, fp[:12], w.registrations)
        self._maybe_switch_model()
        self.dispatch()

    def routes(self) -> list[list[str]]:
        """[worker id, direct endpoint, host, CURVE key] of each ready worker of the pool's model that takes clients'
        requests itself (docs/architecture.md, "The data path"): a client may send them there, and comes back here
        when that fails. Without keys the endpoints are loopback, of use on the worker's own host only, and the row
        has no key (three columns, as clients before keyed routes read it); with keys the client authenticates the
        worker by that key, wherever it is."""
        return [[w.id, w.direct, w.host, *([w.direct_key] if w.direct_key else [])] for w in self.workers.values()
                if w.direct and w.state is WorkerState.READY and w.fingerprint == self.pool_fp]

    def on_worker_reply(self, w: WorkerInfo, msg: wire.Message) -> None:
        rep = wire.parse_reply(msg, arrays=False)     # checked; its buffers go to the client untouched
        job = self.inflight.get(rep.rid) if isinstance(rep.rid, int) else None
        if job is None or job.worker != w.id or job.kind != "request":
            self.counters["late_replies"] += 1    # a job already re-run elsewhere, or from before a restart
            return
        del self.inflight[job.id]
        w.inflight.discard(job.id)
        reason = rep.error.get("reason") if rep.error else None
        if rep.status == wire.STATUS_RETRYABLE:
            self._worker_handed_back(w, job, reason, rep.message)
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
            # hops and hand-offs go (scripts/overhead.py splits the legs with them).
            rep.metrics["broker_in"], rep.metrics["broker_out"], rep.metrics["broker_back"] = (
                job.arrived, job.dispatched, now)
        self._finish(job, wire.encode(Cmd.REPLY, header, *msg.frames))
        # After the reply is on its way: the metering is ours, the client need not wait for it.
        self.meter.answered(w.id, rep.status, reason, job.req.rows, job.req.tokens, now - job.arrived,
                            now - job.dispatched, rep.metrics)

    def _worker_handed_back(self, w: WorkerInfo, job: Job, reason: str | None, message: str) -> None:
        """A retryable answer from `w`: `job` expired there, broke it, or must run elsewhere."""
        if reason == Reason.EXPIRED:
            self._expired(job, "worker")      # the worker skipped it: its caller had given up
        elif reason == Reason.WORKER_FAULT:
            # The worker failed running it (and is going down): that is a lost attempt, bounded by
            # max_attempts, so one poisonous request cannot take down worker after worker.
            self._lost(job, w, "the worker failed running it")
        else:
            # The worker is stopping (or could not take it): another worker runs it, up to max_bounces times.
            self._bounce(job, message or "workers keep handing this request back")

    def _bounce(self, job: Job, message: str) -> None:
        """`job` back to the queue as a hand-back, or failed once it has been handed back max_bounces times. One
        addressed to a worker waits there for that worker's return (a restart, a reload): failing it at once would
        fail a call whose worker is back in seconds (a review of 3966d4f); one whose worker stays down fails when
        its deadline or --queue-timeout runs out."""
        if not self._requeue(job, lost=False):
            self._fail(job, wire.STATUS_RETRYABLE, message, reason=Reason.BOUNCED)

    def on_worker_card(self, w: WorkerInfo, msg: wire.Message) -> None:
        rid = wire.get(msg.header, "rid", int, default=None)
        status = wire.get(msg.header, "status", str, default=wire.STATUS_OK)
        if status == wire.STATUS_OK:
            body = wire.body_of(msg)       # raises before anything changes: the worker is then confused
            if not isinstance(body, dict) or body.get("fingerprint") != w.fingerprint:
                raise wire.ProtocolError("body", "the card does not carry this worker's fingerprint")
            self.cards[w.fingerprint] = zmq.Frame(bytes(msg.frames[0]))
        job = self.inflight.get(rid) if rid is not None else None
        if job is None or job.kind != "describe" or job.worker != w.id:
            return
        del self.inflight[job.id]
        w.inflight.discard(job.id)
        if status == wire.STATUS_OK and w.fingerprint == self.pool_fp:
            self._to_client(job.envelope, wire.encode(Cmd.DESCRIBE, {"rid": job.client_rid, "status": wire.STATUS_OK,
                                                                     "fp": w.fingerprint, **self._capacity()},
                                                      self.cards[w.fingerprint]))
            return
        if not self._requeue(job, lost=False):
            self._fail(job, wire.STATUS_RETRYABLE, "no worker could describe the model")

    def _worker_lost(self, w: WorkerInfo, state: WorkerState, why: str, lost: bool = True) -> None:
        prev = w.state
        w.state = state
        if state is WorkerState.DEAD or w.inflight:
            log.warning("worker %s (%s, pid %s) %s: %s; %d requests to re-send", w.id, prev, w.pid, state, why,
                        len(w.inflight))
        else:
            log.info("worker %s %s: %s", w.id, state, why)
        self._requeue_from(w, why, lost)
        self._maybe_switch_model()

    def _requeue_from(self, w: WorkerInfo, why: str, lost: bool = True) -> None:
        for jid in sorted(w.inflight, reverse=True):
            job = self.inflight.pop(jid, None)
            if job is None:
                continue
            if lost:
                self._lost(job, w, why)
            else:
                self._bounce(job, f"workers keep handing this request back (last: worker {w.id}, {why})")
        w.inflight.clear()

    def _lost(self, job: Job, w: WorkerInfo, why: str) -> None:
        """Send a job `w` lost to another worker, or fail it once `max_attempts` workers have lost it."""
        w.lost += 1
        self.counters["requeued"] += 1
        if not self._requeue(job, lost=True):
            tag = job.req.tag if job.req is not None else f"describe {job.client_rid}"
            log.warning("request %s failed: %d workers were lost while running it (last: worker %s, %s)", tag,
                        job.attempts, w.id, why, extra={"request": tag})
            self._fail(job, wire.STATUS_FINAL, f"{job.attempts} workers were lost while running this request "
                                               f"(last: worker {w.id}, {why})", reason=Reason.WORKERS_LOST)

    def _requeue(self, job: Job, *, lost: bool) -> bool:
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

    # -------------------------------------------------------------------------------------------- dispatch

    def _job_id(self) -> int:
        self.next_job += 1
        return self.next_job

    def _serving(self) -> list[WorkerInfo]:
        """Ready workers of the pool's model."""
        return [w for w in self.workers.values() if w.state is WorkerState.READY and w.fingerprint == self.pool_fp]

    def _candidates(self) -> list[WorkerInfo]:
        # A worker serving another model ("mismatch") only takes requests that name it (`_pick`): that is
        # how compare_workers examines it, and ordinary traffic never lands there.
        return [w for w in self.workers.values() if len(w.inflight) < w.credit and w.state.dispatchable
                and (w.state is WorkerState.MISMATCH or w.fingerprint == self.pool_fp)]

    def dispatch(self) -> None:
        if not self.queue:
            return
        free = self._candidates()
        if not free and not self.describes_queued:
            return
        kept: list[Job] = []
        while self.queue:
            job = self.queue.popleft()
            w = self._pick(job, free)
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

    def _pick(self, job: Job, free: list[WorkerInfo]) -> WorkerInfo | None:
        """The worker `job` goes to now, by the pool's routing policy (protocol/routing.py); None: it waits."""
        if job.kind == "describe":
            return self.choose(self._serving())
        if job.target is not None:          # a request that names its worker goes there or waits
            w = self.workers.get(job.target)
            return w if w is not None and w in free and w.fits(job.req) else None
        best = self.choose(free)
        if best is None or (best.fingerprint == self.pool_fp and best.fits(job.req)):
            return best
        # A worker of another model came first (free only for the requests that name it), or one too small for this
        # request: choose among those that take it. The choice among all free workers is the choice among those
        # that take the request whenever it takes it, so the common case above builds nothing per request.
        return self.choose([w for w in free if w.fingerprint == self.pool_fp and w.fits(job.req)])

    def _send_job(self, w: WorkerInfo, job: Job) -> bool:
        # A fresh id per dispatch: a late reply to an earlier attempt (the job went back to the queue and,
        # perhaps, to the same worker id) can never be taken for the answer to this one.
        job.id = self._job_id()
        now = time.monotonic()
        budget = None if job.expires is None else max(0, int((job.expires - now) * 1e3))   # what is left of it
        if job.kind == "describe":
            ok = self._to_worker(w, Cmd.DESCRIBE, {"rid": job.id})
        else:
            ok = self._to_data(w, wire.encode(Cmd.REQUEST, wire.request_header_for_worker(job.req, job.id, budget),
                                              *job.payload))
        if not ok:
            self._worker_lost(w, WorkerState.DEAD, "unreachable")
            return False
        job.worker, job.dispatched = w.id, now
        w.last_dispatch = job.dispatched
        self.drain.note(now)
        if job.kind == "request":
            self.meter.dispatched(job.dispatched - job.enqueued)
        w.inflight.add(job.id)
        self.inflight[job.id] = job
        return True

    def _finish(self, job: Job, frames: list[Any]) -> None:
        frames = _shared(frames)
        self._to_client(job.envelope, frames)      # first: the bookkeeping below is the broker's own
        if job.key is not None:
            self._forget(job)
            self.replies.put(job.key, frames, time.monotonic())
        self.counters["replies"] += 1

    def _fail(self, job: Job, status: str, message: str, reason: Reason | None = None) -> None:
        if job.key is not None:
            self._forget(job)
        cmd = Cmd.DESCRIBE if job.kind == "describe" else Cmd.REPLY
        self._client_error(job.envelope, job.client_rid, status, message, cmd=cmd, reason=reason)

    def _forget(self, job: Job) -> None:
        """A request is no longer queued or running: its key and payload bytes are released."""
        if self.by_key.pop(job.key, None) is not None:
            self.queue_bytes -= job.nbytes


_MORE = wire.DONTWAIT | wire.SNDMORE


def _frame_sender(sock: zmq.Socket) -> Callable[[Any, int], Any]:
    """`sock.send` without pyzmq's Python wrapper around it, which only adds draft-socket options (routing_id,
    group) a ROUTER never uses: 0.14 against 0.32 us a frame, and a routed request is 15 frames out."""
    return types.MethodType(zmq.backend.Socket.send, sock)


def _expiry(now: float, budget_ms: int | None) -> float | None:
    """When a request's caller gives up, on this broker's clock: its budget counts from its arrival here."""
    return None if budget_ms is None else now + budget_ms / 1e3


SHARE_BYTES = 8 << 10


def _shared(frames: list[Any]) -> list[Any]:
    """Large frames as zmq.Frames: ZeroMQ then shares one buffer among every send of it (a cached reply sent
    to each retry) instead of copying it per send, so a peer cannot multiply the broker's memory by asking."""
    return [zmq.Frame(f) if isinstance(f, bytes) and len(f) >= SHARE_BYTES else f for f in frames]


def _natural(s: str) -> tuple:
    return (0, int(s), "") if s.isdigit() else (1, 0, s)


# ------------------------------------------------------------------------------------------------ process

# The broker's policy flags, defined once: `python -m laya_pool.broker.broker`, `laya-pool broker` and `laya-pool up`
# (which hands them to the broker it starts) all take these. (flag, BrokerConfig field, type, help)
POLICY_FLAGS = (
    ("--queue-size", "queue_size", int, "requests waiting for a worker before the pool answers busy"),
    ("--queue-timeout", "queue_timeout_s", float, "seconds a request may wait for a worker"),
    ("--queue-max-bytes", "queue_max_bytes", int, "request payload bytes waiting or running, together"),
    ("--cache-max-bytes", "cache_max_bytes", int, "bytes of finished replies kept for retries"),
    ("--max-attempts", "max_attempts", int, "workers a request may be lost on before it fails"),
    ("--job-timeout", "job_timeout_s", float,
     "seconds a worker may hold one request before it is declared hung (counted from dispatch, so it includes "
     "the wait behind the worker's other requests: keep it well above credit x the slowest request)"),
    ("--max-message-bytes", "max_frontend_bytes", int, "largest frame a client may send"),
    ("--max-restarts", "max_restarts", int, "restart-worker commands accepted per --restart-window"),
    ("--restart-window", "restart_window_s", float, "seconds over which --max-restarts counts"),
    ("--client-hwm", "client_hwm", int, "replies queued per client before more are dropped"),
    ("--poll-us", "poll_us", int,
     "after each message, keep polling without sleeping for this many microseconds, so the next message (a reply "
     "a forward later, the next request) finds the broker awake: a thread woken from a sleep of a millisecond or "
     "more answers 0.1-0.2 ms late on a VM's cores (docs/PERF.md, twelfth session). Costs a core while traffic "
     "flows; 0: off"),
)


def add_arguments(p: argparse.ArgumentParser, *, supervised: bool = False) -> None:
    """The broker's flags. `supervised` (for `laya-pool up`): the backend defaults to a private ipc socket
    and the fingerprint comes from the checkpoint, so neither is asked for."""
    d = BrokerConfig()
    p.add_argument("--frontend", default=contract.default_frontend(),
                   help="endpoint clients connect to (default %(default)s)")
    if supervised:
        p.add_argument("--backend", default=None, help="endpoint workers connect to (default: a private ipc socket)")
    else:
        p.add_argument("--backend", default=d.backend, help="endpoint workers connect to (default %(default)s)")
        p.add_argument("--fingerprint", default=None, help="serve only this model (sha256 of the checkpoint)")
    p.add_argument("--heartbeat-ms", type=int, default=d.heartbeat_ms,
                   help="milliseconds between heartbeats of the broker and each worker (default %(default)s)")
    p.add_argument("--liveness", type=int, default=d.liveness, help="heartbeats missed before a worker is dead")
    for flag, name, kind, text in POLICY_FLAGS:
        p.add_argument(flag, dest=name, type=kind, default=getattr(d, name), help=f"{text} (default %(default)s)")
    p.add_argument("--keys", default=None, help="CURVE key directory (laya-pool keys --out DIR)")
    p.add_argument("--insecure-backend", action="store_true",
                   help="allow a tcp backend without keys (development only: any local process could register "
                        "as a worker)")


def policy_argv(a: argparse.Namespace) -> list[str]:
    """The policy flags of a parsed command line, as arguments for `python -m laya_pool.broker.broker`."""
    return [arg for flag, name, _, _ in POLICY_FLAGS for arg in (flag, str(getattr(a, name)))]


def config_from_args(a: argparse.Namespace) -> BrokerConfig:
    return BrokerConfig(frontend=a.frontend, backend=a.backend, heartbeat_ms=a.heartbeat_ms, liveness=a.liveness,
                        keys=a.keys, fingerprint=a.fingerprint, insecure_backend=a.insecure_backend,
                        **{name: getattr(a, name) for _, name, _, _ in POLICY_FLAGS})


def serve(cfg: BrokerConfig) -> int:
    try:
        broker = Broker(cfg)
    except security.SecurityError as e:
        log.error("%s", e)
        return contract.EXIT_USAGE
    except security.EndpointInUse as e:
        log.error("%s", e)
        return contract.EXIT_CONFIG
    except zmq.ZMQError as e:
        log.error("cannot bind %s / %s: %s%s", cfg.frontend, cfg.backend, e, " (another pool or program holds "
                  "the port: `laya-pool status --frontend ...` shows whose)" if e.errno == zmq.EADDRINUSE else "")
        return contract.EXIT_CONFIG
    if cfg.insecure_backend and cfg.backend.startswith("tcp://") and not cfg.keys:
        log.warning("--insecure-backend: %s takes workers without keys; any process that reaches it can register "
                    "as a worker and answer clients. Development only.", cfg.backend)

    def stop(signum, _frame):
        broker.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return broker.run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m laya_pool.broker.broker", description="the laya-pool broker")
    add_arguments(p)
    p.add_argument("--log-level", default=None, help="default: $LAYA_POOL_LOG or INFO")
    p.add_argument("--log-format", default=None, help="text or json (default: $LAYA_POOL_LOG_FORMAT or text)")
    a = p.parse_args(argv)
    logs.setup("broker", a.log_level, a.log_format)
    return serve(config_from_args(a))


if __name__ == "__main__":
    sys.exit(main())
