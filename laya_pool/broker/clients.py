"""What the broker does with a client's message (the frontend): requests, describe calls, status, pings, and the
operator's commands (drain, restart-worker, reload), which need the pool's operator credential.

A malformed message is answered with an error naming the field (final: resending it cannot help); a request larger
than every ready worker's capacity is refused at once; a full queue answers "busy", retryable, with the time the
queue needs to drain as the retry-after hint, instead of growing.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from laya_pool.protocol import wire
from laya_pool.protocol.contract import Reason, WorkerState
from laya_pool.protocol.wire import Cmd

from . import operator
from .config import BrokerConfig
from .dispatch import Dispatcher, Job, expiry
from .monitor import LogLimiter
from .overload import retry_after
from .replies import frames_bytes
from .sockets import Sockets
from .table import WorkerInfo, WorkerTable

log = logging.getLogger("laya-pool.broker")


class ClientHandlers:
    def __init__(self, cfg: BrokerConfig, sockets: Sockets, table: WorkerTable, dispatcher: Dispatcher,
                 counters: Counter, say: LogLimiter, status: Callable[[], dict[str, Any]],
                 operator_keys: set[str]):
        self.cfg, self.sockets, self.table, self.dispatcher = cfg, sockets, table, dispatcher
        self.counters, self.say, self.status = counters, say, status
        self.operator_keys = operator_keys
        self.restarts = operator.RestartLimit(cfg.max_restarts, cfg.restart_window_s)
        self.op_token, self.op_path = None, None
        if cfg.operator_secret:     # after binding: a broker that could not bind never replaces a pool's secret
            self.op_token, self.op_path = operator.publish_secret(cfg.frontend)

    def close(self) -> None:
        if self.op_path is not None:
            operator.remove_secret(self.op_path, self.op_token)

    def on_message(self, frames: list[bytes]) -> None:
        self.counters["frontend_messages"] += 1
        # DEALER clients send [identity, proto, ...]; REQ clients add an empty delimiter.
        cut = 2 if len(frames) > 1 and frames[1] == b"" else 1
        envelope, body = frames[:cut], frames[cut:]
        try:
            msg = wire.decode(body)
        except wire.ProtocolError as e:
            self.counters["malformed"] += 1
            self.sockets.client_error(envelope, wire.rid_of(body) if body else None, wire.STATUS_FINAL,
                                      str(e), field=e.field, like=body)
            return
        try:
            if msg.cmd == Cmd.REQUEST:
                self.on_request(envelope, msg)
            elif msg.cmd == Cmd.DESCRIBE:
                self.on_describe(envelope, msg)
            elif msg.cmd == Cmd.STATUS:
                rid = wire.get(msg.header, "rid", (int, str), default=None)
                self.sockets.to_client(envelope, wire.encode_body_reply(Cmd.STATUS, rid, self.status()))
            elif msg.cmd == Cmd.DRAIN:
                self.on_drain(envelope, msg)
            elif msg.cmd == Cmd.RELOAD:
                self.on_reload(envelope, msg)
            elif msg.cmd == Cmd.HEARTBEAT:
                routes = {"routes": self.table.routes()} if msg.header.get("routes") is True else {}
                self.sockets.to_client(envelope, wire.encode(Cmd.HEARTBEAT, {"rid": msg.header.get("rid"),
                                                                              "status": wire.STATUS_OK, **routes}))
            else:
                raise wire.ProtocolError("command", f"{msg.cmd.name} is not a client command")
        except wire.ProtocolError as e:
            self.counters["malformed"] += 1
            self.sockets.client_error(envelope, wire.rid_of(body), wire.STATUS_FINAL, str(e), field=e.field,
                                      cmd=msg.cmd if msg.cmd in (Cmd.STATUS, Cmd.DRAIN, Cmd.DESCRIBE, Cmd.RELOAD)
                                      else Cmd.REPLY)

    # -------------------------------------------------------------------------------------------- requests

    def on_request(self, envelope: list[bytes], msg: wire.Message) -> None:
        # The header and the buffers' sizes are checked; the buffers themselves go to the worker untouched.
        req = wire.parse_request_head(msg, need_cid=True)   # dedup needs an id that survives reconnects
        self.counters["requests"] += 1
        key = (req.cid, req.rid)
        d = self.dispatcher
        if d.join(key, envelope, req.budget_ms):
            return
        if req.worker is not None and not self._target_ready(req, envelope):
            return
        self.table.check_capacity(req)
        size = frames_bytes(msg.frames)
        if len(d.queue) >= self.cfg.queue_size or d.queue_bytes + size > self.cfg.queue_max_bytes:
            self._busy(envelope, req.rid, Cmd.REPLY)
            return
        now = time.monotonic()
        d.add(Job(d.job_id(), "request", key, envelope, req.rid, req=req, payload=msg.frames, target=req.worker,
                  enqueued=now, nbytes=size, arrived=now, expires=expiry(now, req.budget_ms)))

    def _busy(self, envelope: list[bytes], rid: Any, cmd: Cmd) -> None:
        """Turn a request away (the queue is full) with the time the queue needs to drain as the retry-after."""
        self.counters["busy"] += 1
        d = self.dispatcher
        wait = retry_after(len(d.queue), d.drain.rate(time.monotonic()))
        self.sockets.client_error(envelope, rid, wire.STATUS_RETRYABLE, f"the pool is busy ({len(d.queue)} requests, "
                                  f"{d.queue_bytes} B queued); retry after {wait:.2f} s", cmd=cmd, reason=Reason.BUSY,
                                  retry_after=wait)

    def _target_ready(self, req: wire.RequestHead, envelope: list[bytes]) -> bool:
        """A request that names its worker: final if there is no such worker, retryable while it is not ready."""
        w = self.table.workers.get(req.worker)
        if w is None:
            raise wire.ProtocolError("worker", f"no worker {req.worker!r} in this pool")
        if not w.state.dispatchable:   # a named mismatched worker is reachable: diagnostics
            self.sockets.client_error(envelope, req.rid, wire.STATUS_RETRYABLE, f"worker {req.worker!r} is {w.state}",
                                      reason=Reason.WORKER_UNAVAILABLE)
            return False
        return True

    def on_describe(self, envelope: list[bytes], msg: wire.Message) -> None:
        rid = wire.get(msg.header, "rid", (int, str), default=None)
        fp = self.table.pool_fp
        if fp in self.table.cards:
            card = self.table.cards[fp]
            self.sockets.to_client(envelope, wire.encode(Cmd.DESCRIBE, {"rid": rid, "status": wire.STATUS_OK, "fp": fp,
                                                                        **self.table.capacity()}, card), len(card))
            return
        if len(self.dispatcher.queue) >= self.cfg.queue_size:
            self._busy(envelope, rid, Cmd.DESCRIBE)
            return
        job = Job(self.dispatcher.job_id(), "describe", None, envelope, rid, enqueued=time.monotonic())
        job.expires = expiry(job.enqueued, wire.budget_of(msg.header))
        self.dispatcher.add(job)

    # -------------------------------------------------------------------------------------------- operator

    def on_drain(self, envelope: list[bytes], msg: wire.Message) -> None:
        rid = wire.get(msg.header, "rid", (int, str), default=None)
        wid = wire.get(msg.header, "worker", str)
        restart = wire.get(msg.header, "restart", bool, default=False)
        if not self._operator_may(envelope, msg, rid):
            return
        w = self.table.workers.get(wid)
        if w is None:
            raise wire.ProtocolError("worker", f"no worker {wid!r} in this pool")
        if restart and not self._restart_allowed(envelope, rid, w):
            return
        if not w.state.connected and restart:
            # It is down (drained, stopped, dead): the supervisor sees this flag in the status and starts it.
            w.restart_requested = True
            self.sockets.to_client(envelope, wire.encode_body_reply(Cmd.DRAIN, rid, {
                "worker": wid, "state": w.state, "restart": True, "restart_requested": True, "inflight": 0,
                "registrations": w.registrations, "pid": w.pid}))
            return
        if not w.state.connected:
            self.sockets.client_error(envelope, rid, wire.STATUS_FINAL, f"worker {wid!r} is {w.state}",
                                      field="worker", cmd=Cmd.DRAIN)
            return
        w.state, w.drain_restart = WorkerState.DRAINING, restart
        self.sockets.to_worker(w, Cmd.DRAIN, {"restart": restart})
        log.info("worker %s: draining%s (%d in flight)", wid, " for a restart" if restart else "", len(w.inflight))
        self.sockets.to_client(envelope, wire.encode_body_reply(Cmd.DRAIN, rid, {
            "worker": wid, "state": w.state, "restart": restart, "inflight": len(w.inflight),
            "registrations": w.registrations, "pid": w.pid}))
        self.dispatcher.dispatch()

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
        t = self.table
        t.reload = {"id": wire.get(msg.header, "id", str, default=str(rid))[:64], "model": model,
                    "fingerprint": fp, "previous": t.pool_fp or ""}
        log.info("reload requested: model %s (%s), serving %s until enough workers have it", fp[:12], model,
                 (t.pool_fp or "?")[:12])
        self.sockets.to_client(envelope, wire.encode_body_reply(Cmd.RELOAD, rid, {"reload": t.reload}))
        self.dispatcher.switch_model()

    def _operator_may(self, envelope: list[bytes], msg: wire.Message, rid: Any, cmd: Cmd = Cmd.DRAIN) -> bool:
        """A command that changes the pool: only from a peer with the operator secret or the operator key."""
        user = self.sockets.peer_user
        if operator.token_matches(msg.header.get("op"), self.op_token) or (
                user is not None and user in self.operator_keys):
            return True
        self.counters["not_allowed"] += 1
        self.say("not-allowed", logging.WARNING, "refused a drain/restart from a peer without the operator "
                 "credential (a plain client): the pool keeps serving")
        how = (f"run `laya-pool drain` / `restart-worker` as the user who started the pool (it reads the secret in "
               f"{operator.runtime_dir()})")
        if self.cfg.keys:
            how += ", or connect with the operator key (keys=DIR with operator.key_secret)"
        self.sockets.client_error(envelope, rid, wire.STATUS_FINAL, f"not allowed: drain, restart and reload need "
                                  f"the pool's operator credential; {how}", field="op", cmd=cmd,
                                  reason=Reason.NOT_ALLOWED)
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
        self.sockets.client_error(envelope, rid, wire.STATUS_FINAL, f"restart refused: at most "
                                  f"{self.cfg.max_restarts} restarts per {self.cfg.restart_window_s:g} s "
                                  f"(--max-restarts, --restart-window); try again in {wait:.0f} s", field="restart",
                                  cmd=Cmd.DRAIN, reason=Reason.RATE_LIMITED)
        return False
