"""The broker: routes requests from clients (frontend ROUTER) to workers (backend ROUTER).

Its parts, each a class of its own:
- `WorkerTable` (broker/table.py): the workers: id, device, model fingerprint, capacity, credit, liveness, state;
- `Dispatcher` (broker/dispatch.py): the bounded queue, the in-flight table, deduplication of retries, deadlines,
  and dispatch: each job to the worker the pool's routing policy chooses (protocol/routing.py), a lost job to
  another worker, never dropped silently;
- `ClientHandlers` (broker/clients.py) and `WorkerHandlers` (broker/workers.py): what each message does, and the
  workers' liveness (heartbeats both ways, Paranoid Pirate);
- `Sockets` (broker/sockets.py): the two ROUTER sockets and sends that never wait;
- `Meter` (broker/metering.py): outcomes, per-worker work and timings for the operations surface.
`Broker` builds them and runs the loop: workers' messages first (their replies free credit), then clients', then
housekeeping (liveness, expired requests and replies) and dispatch.

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
from collections.abc import Callable
from typing import Any

import zmq

from laya_pool.protocol import contract, logs, settings, wire
from laya_pool.protocol.contract import Reason

from . import operator, security
from .clients import ClientHandlers
from .config import BrokerConfig
from .dispatch import Dispatcher
from .metering import Meter
from .monitor import LogLimiter
from .sockets import Sockets
from .table import WorkerTable
from .workers import WorkerHandlers

log = logging.getLogger("laya-pool.broker")
OBSERVE_S = 1.0         # with --http: a status for the metrics this often (as `up` polls its broker)


class Broker:
    def __init__(self, cfg: BrokerConfig, ctx: zmq.Context | None = None):
        self.cfg = cfg
        security.check_endpoints(cfg.frontend, cfg.backend, cfg.keys, cfg.insecure_backend)
        self.counters: collections.Counter[str] = collections.Counter()
        self.meter = Meter()                    # outcomes, per-worker work and timings (broker/metering.py)
        self.say = LogLimiter(log)
        operator_keys = operator.operator_keys(cfg.keys)
        self.sockets = Sockets(cfg, ctx or zmq.Context.instance(), self.counters, self.meter, self.say,
                               users=bool(operator_keys))
        self.frontend, self.backend = self.sockets.frontend, self.sockets.backend
        self.table = WorkerTable(cfg)
        self.dispatcher = Dispatcher(cfg, self.sockets, self.table, self.meter, self.counters)
        self.client_handlers = ClientHandlers(cfg, self.sockets, self.table, self.dispatcher, self.counters,
                                              self.say, self.status, operator_keys)
        self.worker_handlers = WorkerHandlers(cfg, self.sockets, self.table, self.dispatcher, self.meter,
                                              self.counters, self.say)
        # The loop's two entry points: a message from a client, one from a worker.
        self.on_frontend, self.on_backend = self.client_handlers.on_message, self.worker_handlers.on_message
        self.hb = cfg.heartbeat_ms / 1000.0
        self.started = time.monotonic()
        self.stopping = False
        self.last_housekeeping = 0.0
        self.observer: Any = None        # broker.observe.PoolObserver, with --http: fed a status every OBSERVE_S
        self.last_observed = 0.0

    # -------------------------------------------------------------------------------------------- loop

    def run(self) -> int:
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        for watch in self.sockets.watches:
            poller.register(watch.sock, zmq.POLLIN)
        log.info("broker %d: frontend %s, backend %s, heartbeat %d ms x %d", os.getpid(), self.cfg.frontend,
                 self.cfg.backend, self.cfg.heartbeat_ms, self.cfg.liveness)
        awake_until = 0.0                 # --poll-us: poll without sleeping until then
        while not self.stopping:
            timeout = max(1, int(self.hb * 1000 / 2))
            if self.dispatcher.queue:
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
            for watch in self.sockets.watches:
                if events.get(watch.sock):
                    watch.handle()
            self.tick()
        self.shutdown()
        return 0

    def _receive_all(self, sock: zmq.Socket, handler: Callable[[list[bytes]], None], limit: int = 1000) -> None:
        """Handle what `sock` holds, at most `limit` messages, so one side cannot starve the other."""
        # Per message only the receive and the handler (this loop runs four times per routed request): the
        # receiver is chosen once, and the guard is inline (a bug met by one message must not take the pool's
        # routing table down with it).
        recv = self.sockets.receiver(sock)
        for _ in range(limit):
            try:
                frames = recv(sock)
            except zmq.Again:
                return
            try:
                handler(frames)
            except Exception:  # noqa: BLE001
                self._internal_error(handler, frames)

    def _internal_error(self, handler: Callable[[list[bytes]], None], frames: list[bytes]) -> None:
        """`handler` raised on `frames` (a bug): logged and counted; a client is told to retry."""
        self.counters["internal_errors"] += 1
        log.exception("broker: internal error while handling a message")
        if handler == self.on_frontend:
            cut = 2 if len(frames) > 1 and frames[1] == b"" else 1
            with contextlib.suppress(Exception):
                self.sockets.client_error(frames[:cut], wire.rid_of(frames[cut:]) if len(frames) > cut else None,
                                          wire.STATUS_RETRYABLE, "internal broker error", reason=Reason.INTERNAL)

    def tick(self) -> None:
        """Between messages: dispatch, and every few tens of milliseconds the housekeeping first."""
        now = time.monotonic()
        if now - self.last_housekeeping >= self._housekeeping_s():
            self.last_housekeeping = now
            self.worker_handlers.watch(now)
            self.dispatcher.expire_queue(now)
            self.dispatcher.replies.expire(now)
            self.sockets.housekeeping(now)
            if self.observer is not None and now - self.last_observed >= OBSERVE_S:
                self.last_observed = now
                self.observer.update(self.status(), now)
        self.dispatcher.dispatch()

    def _housekeeping_s(self) -> float:
        return min(0.05, self.hb / 4)

    def shutdown(self) -> None:
        self.dispatcher.shutdown()
        self.client_handlers.close()
        self.worker_handlers.close()
        self.sockets.close()

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        d, cfg = self.dispatcher, self.cfg
        return {"workers": self.table.rows(now),
                "broker": {"pid": os.getpid(), "frontend": cfg.frontend, "backend": cfg.backend,
                           "fingerprint": self.table.pool_fp, "reload": self.table.reload,
                           "uptime_s": round(now - self.started, 3),
                           "heartbeat_ms": cfg.heartbeat_ms, "liveness": cfg.liveness,
                           "queue": len(d.queue), "queue_size": cfg.queue_size,
                           "drain_per_s": round(d.drain.rate(now), 3),
                           "queue_bytes": d.queue_bytes, "cached_reply_bytes": d.replies.bytes,
                           "inflight": len(d.inflight), "cached_replies": len(d.replies),
                           "unread_reply_bytes": self.sockets.unread.total,
                           "counters": dict(self.counters)},
                "meter": self.meter.snapshot()}


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
    ("--unread-max-bytes", "unread_max_bytes", int,
     "bytes of replies the broker holds that their clients have not taken yet, all clients together: beyond them no "
     "reply goes to a client that has left one untaken for 50 ms"),
    ("--poll-us", "poll_us", int,
     "after each message, keep polling without sleeping for this many microseconds, so the next message (a reply "
     "a forward later, the next request) finds the broker awake: a thread woken from a sleep of a millisecond or "
     "more answers 0.1-0.2 ms late on a VM's cores; 3000 took 0.29 ms off a request routed through the broker. "
     "Costs a core while traffic flows; 0: off (the default: clients send to workers directly, so the broker is "
     "off the request path)"),
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
                   help="take workers without keys or proof: allow a tcp backend without keys, and on an ipc one "
                        "register workers that do not prove the pool started them (development only: any local "
                        "process that reaches the backend could register as a worker)")
    if not supervised:          # `up` serves them itself
        p.add_argument("--http", default=None, metavar="[HOST:]PORT",
                       help="serve /metrics and /health/{live,ready} here (a bare port: 127.0.0.1; beyond loopback "
                            "with --keys only; default: off)")


def policy_argv(a: argparse.Namespace) -> list[str]:
    """The policy flags of a parsed command line, as arguments for `python -m laya_pool.broker.broker`."""
    return [arg for flag, name, _, _ in POLICY_FLAGS for arg in (flag, str(getattr(a, name)))]


def config_from_args(a: argparse.Namespace) -> BrokerConfig:
    return BrokerConfig(frontend=a.frontend, backend=a.backend, heartbeat_ms=a.heartbeat_ms, liveness=a.liveness,
                        keys=a.keys, fingerprint=a.fingerprint, insecure_backend=a.insecure_backend, http=a.http,
                        **{name: getattr(a, name) for _, name, _, _ in POLICY_FLAGS})


def serve(cfg: BrokerConfig) -> int:
    if cfg.http:
        from .ops_http import refusal
        why = refusal(cfg.http, cfg.keys)
        if why is not None:
            log.error("%s", why)
            return contract.EXIT_USAGE
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
    http = _serve_http(broker) if cfg.http else None
    if cfg.http and http is None:
        broker.shutdown()
        return contract.EXIT_CONFIG
    try:
        return broker.run()
    finally:
        if http is not None:
            http.close()


def _serve_http(broker: Broker) -> Any:
    """--http: the pool's metrics and health from this process (an HTTP thread; the loop feeds it a status every
    OBSERVE_S), as `up --http` serves them from the supervisor. None when it cannot (the port is taken)."""
    from .observe import PoolObserver
    from .ops_http import MetricsServer
    broker.observer = PoolObserver(lambda: {"stopping": broker.stopping})
    try:
        return MetricsServer(broker.cfg.http, broker.observer)
    except (OSError, ValueError) as e:
        log.error("cannot serve --http %s: %s", broker.cfg.http, e)
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m laya_pool.broker.broker", description="the laya-pool broker",
                                allow_abbrev=False)
    add_arguments(p)
    p.add_argument("--log-level", default=None, help="default: $LAYA_POOL_LOG or INFO")
    p.add_argument("--log-format", default=None, help="text or json (default: $LAYA_POOL_LOG_FORMAT or text)")
    a = p.parse_args(argv)
    logs.setup("broker", a.log_level, a.log_format)
    settings.warn_undeclared(log)
    return serve(config_from_args(a))


if __name__ == "__main__":
    sys.exit(main())
