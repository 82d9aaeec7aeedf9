"""The supervisor (`laya-pool up`): the broker and the worker processes, restarts and a graceful stop.

- starts the broker (`-m laya_pool.broker.broker`) and this host's workers, one per device slot, and restarts a worker
  that exits by its exit code (broker/processes.py, which `laya-pool workers` runs too: at once after a drain for a
  restart, with backoff after a crash, never after a configuration error or a clean drain);
- restarts the broker if it dies (workers re-register with the new one by themselves);
- with `--api`, starts the HTTP gateway beside them (`laya-pool api`, a client of this pool's frontend: gateway/) and
  restarts it if it dies;
- a child it cannot start (out of file descriptors, processes or memory: EMFILE, EAGAIN, ENOMEM) is logged and tried
  again with the same backoff, while the rest of the pool goes on serving;
- brings back a drained worker when `laya-pool restart-worker ID` asks for it (seen in the broker's status);
- carries out `laya-pool reload --model DIR` (seen in the broker's status): the workers move onto DIR one
  at a time (broker/reload.py tells the whole procedure);
- on SIGINT/SIGTERM: the gateway (if any) stops taking HTTP requests and answers those it holds, then every worker
  finishes its in-flight work and leaves, then the broker; exit 0. A worker still there `drain_timeout` (5 s) after it
  was told is SIGKILLed (a hung device never finishes), and the broker fails what it held as retryable when it stops:
  `up` exits within 10 s whatever the workers do (16 s with a gateway).

The supervisor imports neither torch nor the worker package: workers (and the gateway) are subprocesses started by
module name.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from laya_pool.protocol import contract, settings, wire
from laya_pool.protocol.contract import WorkerState

from . import children, rundir
from .children import Child
from .processes import DRAIN_TIMEOUT, WorkerOptions, WorkerProcesses

log = logging.getLogger("laya-pool.supervisor")
BROKER_STOP_S = 2.0     # the broker's grace (it fails what is queued and in flight, then closes: milliseconds)
__all__ = ["DRAIN_TIMEOUT", "Supervisor", "SupervisorConfig"]

GATEWAY_SPIN_US = 2000     # `up --api` on CUDA: the gateway's event loop polls this long after each event


@dataclass
class SupervisorConfig(WorkerOptions):
    """`up`'s settings: its workers' (broker/processes.py), and the broker's and the gateway's beside them."""
    frontend: str = "tcp://127.0.0.1:5555"
    backend: str | None = None          # default: an ipc socket in a private temporary directory
    broker_args: list[str] = field(default_factory=list)
    api: str | None = None              # [HOST:]PORT for the HTTP gateway (gateway/); None: off
    api_key: str | None = None          # its bearer key, handed over in its environment (not on its command line)
    api_processes: int = 1              # its processes (`laya-pool api --processes`)


OPERATOR_RESTART_HOLD_S = 30.0
RELOAD_WORKER_TIMEOUT_S = 600.0     # one worker's stop + start + warm-up during a reload


@dataclass
class Reload:
    """A rolling reload under way (broker/reload.py)."""
    id: str
    model: str
    fingerprint: str
    previous_model: str
    previous_fingerprint: str | None
    todo: list[str]
    total: int
    current: str | None = None
    pid_before: int | None = None
    since: float = 0.0


def gateway_argv(cfg: SupervisorConfig) -> list[str]:
    """`up --api`'s gateway command line (its key goes in the environment, never here)."""
    argv = [sys.executable, "-m", "laya_pool", "api", "--frontend", cfg.frontend, "--listen", cfg.api,
            "--processes", str(cfg.api_processes)]
    if any(d.startswith("cuda") for d in cfg.devices):
        # The event loop polls 2 ms after each event, as a CUDA worker does (decisions/0024); beside CPU workers
        # the polling would take their cores.
        argv += ["--spin-us", str(GATEWAY_SPIN_US)]
    return argv + (["--keys", cfg.keys] if cfg.keys else [])


def _direct_beyond_loopback(cfg: SupervisorConfig, env: dict[str, str]) -> bool:
    """Whether the workers' direct sockets listen where the frontend does: a pool with keys whose frontend is tcp
    beyond loopback, unless the operator chose their endpoint (--direct-endpoint, LAYA_DIRECT_ENDPOINT)."""
    chosen = (settings.raw("LAYA_DIRECT_ENDPOINT", env) is not None
              or any(a.startswith("--direct-endpoint") for a in cfg.worker_args))
    return (bool(cfg.keys) and cfg.frontend.startswith("tcp://") and not wire.is_loopback(cfg.frontend)
            and not chosen)


class Supervisor:
    def __init__(self, cfg: SupervisorConfig):
        self.cfg = cfg
        self.tmp: Path | None = None
        if cfg.backend is None:
            self.tmp = rundir.make_private()
            cfg.backend = f"ipc://{self.tmp}/backend"
        self.env = env = children.environment()
        common = ["--heartbeat-ms", str(cfg.heartbeat_ms), "--liveness", str(cfg.liveness)]
        common += ["--keys", cfg.keys] if cfg.keys else []
        self.broker = self._broker_child(common)
        # Clients that reach the frontend beyond loopback reach the workers' direct sockets on the same address
        # (CURVE servers, with keys): their requests skip the broker (docs/architecture.md, "The data path").
        direct = f"tcp://{wire.endpoint_host(cfg.frontend)}:*" if _direct_beyond_loopback(cfg, env) else None
        self.processes = WorkerProcesses(cfg, cfg.backend, env, direct=direct)
        self.processes.on_config_error = self._reload_failed
        self.workers: dict[str, Child] = self.processes.children
        self.gateway = self._gateway_child() if cfg.api else None
        self.stopping = False
        self.status_client = None
        self.last_poll = 0.0
        self.announced = False
        self.foreign_seen = False
        self.observer = None                # broker.observe.PoolObserver, with --http
        self.reload: Reload | None = None
        self.reloads_seen: set[str] = set()
        self.http = None                    # broker.ops_http.MetricsServer, with --http

    def _broker_child(self, common: list[str]) -> Child:
        cfg = self.cfg
        # Pin the pool to this model: after a broker restart, a stray worker registering first must not
        # redefine what the pool serves.
        try:
            fingerprint = ["--fingerprint", contract.fingerprint(cfg.model)]
        except OSError:
            fingerprint = []       # an unreadable checkpoint: the workers report exactly what is wrong
        return Child("broker", [sys.executable, "-m", "laya_pool.broker.broker", "--frontend", cfg.frontend,
                                "--backend", cfg.backend, *common, *fingerprint, *cfg.broker_args], self.env)

    def _gateway_child(self) -> Child:
        cfg = self.cfg
        env = {k: v for k, v in self.env.items() if k not in ("LAYA_POOL_API_KEY", "LAYA_POOL_API_KEY_FILE")}
        if cfg.api_key:
            env["LAYA_POOL_API_KEY"] = cfg.api_key
        return Child("gateway", gateway_argv(cfg), env)

    def _singles(self) -> list[Child]:
        """The children of which there is one: the broker, and the gateway with --api."""
        return [self.broker] + ([self.gateway] if self.gateway is not None else [])

    # ------------------------------------------------------------------------------------------------ children

    def _reap(self, child: Child) -> None:
        """The broker or the gateway exited: start it again after its backoff, unless it cannot start."""
        code = children.exited(child)
        if code is None:
            return
        if self.stopping:
            child.state = "stopped"
        elif code in (contract.EXIT_USAGE, contract.EXIT_CONFIG):
            log.error("%s cannot start (exit %d: an endpoint or port is in use or refused); stopping", child.name, code)
            child.state = "down"
        else:
            children.crashed(child)

    def _reload_failed(self, wid: str) -> bool:
        """A worker exited with a configuration error: the reload's worker puts the previous model back."""
        if self.reload is None or self.reload.current != wid:
            return False
        self._abort_reload(f"worker {wid} cannot load it (exit {self.workers[wid].last_exit})")
        return True

    def _restart_due(self) -> None:
        now = time.monotonic()
        for child in self._singles():
            if children.due(child, now):
                children.start(child)
        self.processes.restart_due()

    def _poll_broker(self) -> None:
        """Readiness announcement, and workers an operator asked back (restart-worker on a drained worker)."""
        now = time.monotonic()
        if now - self.last_poll < 1.0 or self.broker.state != "running":
            return
        self.last_poll = now
        try:
            if self.status_client is None:
                from laya_pool.client.pool import Client
                self.status_client = Client(self.cfg.frontend, timeout=1.0, retries=0, keys=self.cfg.keys)
            st = self.status_client.status()
        except Exception:  # noqa: BLE001 - the broker may be starting or restarting
            return
        theirs = st.get("broker", {}).get("pid")
        if theirs != self.broker.pid:
            # Another pool's broker answers on our frontend (ours has not bound, or could not): its workers
            # are not ours to announce or restart.
            if not self.foreign_seen:
                log.warning("the frontend %s is answered by another broker (pid %s), not this pool's (pid %s)",
                            self.cfg.frontend, theirs, self.broker.pid)
            self.foreign_seen = True
            return
        if self.observer is not None:
            self.observer.update(st, now)
        rows = {w.get("id"): w for w in st.get("workers", [])}
        for wid, child in self.workers.items():
            # The broker's flag stays up until the worker registers; a worker that dies before that
            # (a bad checkpoint, say) must not be started again every second on the same request.
            if (child.state == "down" and rows.get(wid, {}).get("restart_requested")
                    and now - child.operator_start > OPERATOR_RESTART_HOLD_S):
                log.info("worker %s: restart requested by an operator", wid)
                child.restarts += 1
                child.operator_start = now
                self.processes.start(wid)
        self._follow_reload(st.get("broker", {}).get("reload"), rows, now)
        ready = sum(1 for w in rows.values() if w.get("state") == WorkerState.READY)
        if not self.announced and ready >= len(self.workers):
            self.announced = True
            log.info("pool ready: %d workers on %s, frontend %s", ready, ",".join(self.cfg.devices),
                     self.cfg.frontend)

    # ------------------------------------------------------------------------------------------------ reload

    def _follow_reload(self, request: dict | None, rows: dict, now: float) -> None:
        if request and request.get("id") not in self.reloads_seen and self.reload is None:
            self.reloads_seen.add(request.get("id"))
            self._begin_reload(request)
        if self.reload is not None:
            self._reload_step(rows, now)

    def _use_model(self, model: str, fingerprint: str | None) -> None:
        """Every later start of a worker loads `model`; a restarted broker serves `fingerprint`."""
        self.cfg.model = model
        for child in self.workers.values():
            children.set_flag(child.argv, "--model", model)
        if fingerprint:
            children.set_flag(self.broker.argv, "--fingerprint", fingerprint)

    def _begin_reload(self, request: dict) -> None:
        model, fp = str(request.get("model", "")), str(request.get("fingerprint", ""))
        if not Path(model).is_dir():
            log.error("reload to %s refused: not a directory this supervisor can read", model)
            return
        previous_fp = next((a for a, b in zip(self.broker.argv[1:], self.broker.argv) if b == "--fingerprint"), None)
        if fp == previous_fp:       # by fingerprint, not path: files replaced in place are a new model
            log.info("reload: the pool already runs model %s (%s)", fp[:12], model)
            return
        self.reload = Reload(str(request.get("id")), model, fp, self.cfg.model, previous_fp, list(self.workers),
                             len(self.workers))
        self._use_model(model, fp)
        log.info("reload: moving %d workers onto %s (model %s), one at a time", len(self.workers), model, fp[:12])

    def _reload_step(self, rows: dict, now: float) -> None:
        r = self.reload
        if r.current is not None:
            child, row = self.workers[r.current], rows.get(r.current, {})
            if child.state == "down" and child.last_exit == contract.EXIT_CONFIG:
                self._abort_reload(f"worker {r.current} cannot load it (exit {child.last_exit})")
                return
            if (child.pid not in (None, r.pid_before) and row.get("pid") == child.pid
                    and row.get("fingerprint") == r.fingerprint
                    and row.get("state") in (WorkerState.READY, WorkerState.MISMATCH)):
                done = r.total - len(r.todo)
                log.info("reload: worker %s serves model %s (pid %s; %d of %d)", r.current, r.fingerprint[:12],
                         child.pid, done, r.total)
                r.current = None
            elif now - r.since > RELOAD_WORKER_TIMEOUT_S:
                self._abort_reload(f"worker {r.current} was not ready on it after {RELOAD_WORKER_TIMEOUT_S:g} s")
                return
            else:
                return
        while r.todo:
            wid = r.todo.pop(0)
            child = self.workers[wid]
            if child.state != "running" or child.proc is None or child.proc.poll() is not None:
                continue        # down or between starts: its next start loads the new model
            r.current, r.since, r.pid_before = wid, now, child.pid
            child.reloading = True
            log.info("reload: worker %s (%d of %d): finishing its requests, then restarting on the new model", wid,
                     r.total - len(r.todo), r.total)
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
            return
        log.info("reload done: the pool runs %s (model %s)", r.model, r.fingerprint[:12])
        self.reload = None

    def _abort_reload(self, why: str) -> None:
        """Put the previous model back on the worker that failed; the workers already moved keep the new one."""
        r = self.reload
        self.reload = None
        moved = r.total - len(r.todo) - 1
        self._use_model(r.previous_model, r.previous_fingerprint)
        log.error("reload to %s failed: %s; worker %s goes back to %s%s", r.model, why, r.current, r.previous_model,
                  f" ({moved} workers already moved keep the new model: `laya-pool reload --model "
                  f"{r.previous_model}` moves them back)" if moved > 0 else "")
        child = self.workers[r.current]
        child.reloading = False
        if child.state == "down":
            children.again(child)
        elif child.proc is not None and child.proc.poll() is None:
            child.reloading = True          # a slow start on the new model: stop it, start it on the old one
            child.proc.send_signal(signal.SIGTERM)

    # ------------------------------------------------------------------------------------------------ run

    def run(self) -> int:
        def on_signal(signum, _frame):
            if not self.stopping:
                log.info("received %s: draining", signal.Signals(signum).name)
            self.stopping = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        if self.cfg.http and not self._serve_http():
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            return contract.EXIT_CONFIG
        children.start(self.broker)
        self.processes.start_all()
        if self.gateway is not None:
            children.start(self.gateway)
        try:
            while not self.stopping:
                for child in self._singles():
                    self._reap(child)
                down = next((c for c in self._singles() if c.state == "down"), None)
                if down is not None:
                    self._shutdown()
                    return down.last_exit or contract.EXIT_CONFIG
                self.processes.reap(self.stopping)
                if self.processes.none_can_start():
                    log.error("no worker can start (configuration errors); stopping")
                    self._shutdown()
                    return contract.EXIT_CONFIG
                self._restart_due()
                self._poll_broker()
                time.sleep(0.1)
            self._shutdown()
            return 0
        finally:
            if self.status_client is not None:
                self.status_client.close()
            if self.http is not None:
                self.http.close()
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)

    def _serve_http(self) -> bool:
        """Bind --http before any child starts: a taken port fails `up` at once instead of a pool without metrics."""
        from .observe import PoolObserver
        from .ops_http import MetricsServer
        self.observer = PoolObserver(self._observed)
        try:
            self.http = MetricsServer(self.cfg.http, self.observer)
        except (OSError, ValueError) as e:
            log.error("cannot serve --http %s: %s", self.cfg.http, e)
            return False
        return True

    def _observed(self) -> dict:
        """What only the supervisor knows, read by the HTTP thread at scrape time (ints and a bool: no lock)."""
        return {"stopping": self.stopping, "broker_restarts": self.broker.restarts,
                "worker_restarts": self.processes.restarts()}

    def _shutdown(self) -> None:
        """The gateway first (no new HTTP requests; it answers those it holds), then the workers (each finishes what it
        holds and leaves), then the broker."""
        self.stopping = True
        g = self.gateway.proc if self.gateway is not None else None
        if g is not None and g.poll() is None:
            g.send_signal(signal.SIGTERM)
            try:
                g.wait(self.cfg.drain_timeout + 1.0)
            except subprocess.TimeoutExpired:
                log.warning("the gateway (pid %d) did not stop within %g s; killing it (SIGKILL)", g.pid,
                            self.cfg.drain_timeout + 1.0)
                children.kill(g, "the gateway")
        self.processes.stop()
        b = self.broker.proc
        if b is not None and b.poll() is None:
            b.send_signal(signal.SIGTERM)
            try:
                b.wait(BROKER_STOP_S)
            except subprocess.TimeoutExpired:
                log.warning("the broker (pid %d) did not stop within %g s; killing it (SIGKILL)", b.pid, BROKER_STOP_S)
                children.kill(b, "the broker")
        log.info("pool stopped")
