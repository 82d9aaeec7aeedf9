"""The supervisor (`laya-pool up`): the broker and the worker processes, restarts and a graceful stop.

- starts the broker (`-m laya_pool.broker.broker`) and one worker per device slot (`-m laya_pool.worker.server`),
  each GPU worker with CUDA_VISIBLE_DEVICES set to its GPU, CPU workers pinned to disjoint cores;
- restarts a worker that exits: at once when it drained for a restart (exit 75), with exponential
  backoff after a crash (any other non-zero exit or a signal), never after a configuration error
  (exit 78: the checkpoint is unusable) or a clean drain (exit 0: the operator took it out);
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
import ctypes
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from laya_pool.protocol import contract, settings, wire
from laya_pool.protocol.contract import WorkerState

from . import rundir

log = logging.getLogger("laya-pool.supervisor")
# Where this package lies (a checkout's root, or site-packages): the children import it from there.
HOME = Path(sys.modules[__name__.split(".")[0]].__file__).resolve().parents[1]
BACKOFF_START = 0.5
BACKOFF_MAX = 30.0
STABLE_AFTER = 60.0     # a worker up this long has its backoff reset
DRAIN_TIMEOUT = 5.0     # a stopping worker's grace before SIGKILL: with the broker's below, a stop takes <= 10 s
BROKER_STOP_S = 2.0     # the broker's grace (it fails what is queued and in flight, then closes: milliseconds)
KILLED_WAIT_S = 1.0     # for the kernel to reap a SIGKILLed child; longer means it is stuck in the kernel (D state)


@dataclass
class SupervisorConfig:
    model: str
    devices: list[str]
    workers_per_device: int = 1
    frontend: str = "tcp://127.0.0.1:5555"
    backend: str | None = None          # default: an ipc socket in a private temporary directory
    heartbeat_ms: int = 1000
    liveness: int = 3
    mode: str | None = None
    credit: int | None = None          # None: each worker picks (twice its merge size)
    keys: str | None = None
    broker_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    drain_timeout: float = DRAIN_TIMEOUT
    http: str | None = None             # [HOST:]PORT for /metrics and /health (broker/ops_http.py); None: off
    api: str | None = None              # [HOST:]PORT for the HTTP gateway (gateway/); None: off
    api_key: str | None = None          # its bearer key, handed over in its environment (not on its command line)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    backoff: float = BACKOFF_START
    next_start: float = 0.0
    state: str = "starting"      # running | backoff | down (drained / config error) | stopped
    last_exit: int | None = None
    operator_start: float = float("-inf")   # when an operator's restart-worker last started it
    reloading: bool = False                  # told to stop for a reload: start it again at once

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


try:  # loaded here, in the parent: dlopen after fork, with zmq's threads about, can deadlock the child
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None


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


def _set_flag(argv: list[str], flag: str, value: str) -> None:
    """Replace `flag`'s value in a child's command line (append the pair when it is not there)."""
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the supervisor dies (Linux), so nothing is orphaned."""
    if _LIBC is not None:
        with contextlib.suppress(Exception):
            _LIBC.prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def _spawn_hint(e: BaseException) -> str:
    """What an operator can do about a failed start."""
    no = getattr(e, "errno", None)
    if no in (errno.EMFILE, errno.ENFILE):
        return " (out of file descriptors: raise `ulimit -n`, or find what holds them open)"
    if no == errno.EAGAIN:
        return " (out of processes or threads: see `ulimit -u`)"
    if no == errno.ENOMEM:
        return " (out of memory)"
    return ""


def _cpu_sets(devices: list[str], per_device: int) -> list[list[int] | None]:
    """Disjoint core sets for the CPU workers (GPU workers pick the cores near their GPU themselves)."""
    try:
        import psutil
        cores = sorted(psutil.Process().cpu_affinity())
    except Exception:  # noqa: BLE001
        cores = list(range(os.cpu_count() or 1))
    slots = [d for d in devices for _ in range(per_device)]
    n_cpu = sum(1 for d in slots if d == "cpu")
    out: list[list[int] | None] = []
    i = 0
    chunk = max(1, len(cores) // max(1, n_cpu))
    for d in slots:
        if d != "cpu":
            out.append(None)
            continue
        out.append([cores[(i * chunk + k) % len(cores)] for k in range(chunk)])
        i += 1
    return out


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
        env = dict(os.environ)
        for name, _ in settings.undeclared(env):      # `up` warned of each once; its children read none of them
            del env[name]
        if HOME.name not in ("site-packages", "dist-packages"):     # a checkout goes first; an install is found
            env["PYTHONPATH"] = str(HOME) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.env = env
        common = ["--heartbeat-ms", str(cfg.heartbeat_ms), "--liveness", str(cfg.liveness)]
        common += ["--keys", cfg.keys] if cfg.keys else []
        self.broker = self._broker_child(common)
        cpus = _cpu_sets(cfg.devices, cfg.workers_per_device)
        slots = [d for d in cfg.devices for _ in range(cfg.workers_per_device)]
        self.workers: dict[str, Child] = {str(i): self._worker_child(str(i), device, cpu, common)
                                          for i, (device, cpu) in enumerate(zip(slots, cpus))}
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

    def _worker_child(self, wid: str, device: str, cpus: list[int] | None, common: list[str]) -> Child:
        cfg = self.cfg
        env = dict(self.env)
        if device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1] if ":" in device else "0"
        argv = [sys.executable, "-m", "laya_pool.worker.server", "--model", cfg.model, "--device", device,
                "--backend", cfg.backend, "--id", wid, *common]
        if cfg.credit is not None:
            argv += ["--credit", str(cfg.credit)]
        if cfg.mode:
            argv += ["--mode", cfg.mode]
        if cpus:
            argv += ["--cpus", ",".join(map(str, cpus))]
        if _direct_beyond_loopback(cfg, env):
            # Clients that reach the frontend beyond loopback reach the workers' direct sockets on the same address
            # (CURVE servers, with keys): their requests skip the broker (docs/architecture.md, "The data path").
            argv += ["--direct-endpoint", f"tcp://{wire.endpoint_host(cfg.frontend)}:*"]
        return Child(f"worker {wid}", argv + cfg.worker_args, env)

    def _gateway_child(self) -> Child:
        cfg = self.cfg
        env = {k: v for k, v in self.env.items() if k not in ("LAYA_POOL_API_KEY", "LAYA_POOL_API_KEY_FILE")}
        if cfg.api_key:
            env["LAYA_POOL_API_KEY"] = cfg.api_key
        argv = [sys.executable, "-m", "laya_pool", "api", "--frontend", cfg.frontend, "--listen", cfg.api]
        return Child("gateway", argv + (["--keys", cfg.keys] if cfg.keys else []), env)

    def _singles(self) -> list[Child]:
        """The children of which there is one: the broker, and the gateway with --api."""
        return [self.broker] + ([self.gateway] if self.gateway is not None else [])

    # ------------------------------------------------------------------------------------------------ children

    def _start(self, child: Child, extra: list[str] | None = None) -> None:
        try:
            child.proc = subprocess.Popen(child.argv + (extra or []), env=child.env, preexec_fn=_die_with_parent,
                                          start_new_session=True)
        except (OSError, subprocess.SubprocessError) as e:
            # Out of file descriptors, processes or memory (EMFILE, EAGAIN, ENOMEM): the pool keeps what runs, and
            # this child is tried again with its backoff, as after a crash.
            now = time.monotonic()
            child.state, child.next_start = "backoff", now + child.backoff
            log.error("could not start %s: %s%s; trying again in %.1f s", child.name, e, _spawn_hint(e),
                      child.backoff)
            child.backoff = min(BACKOFF_MAX, child.backoff * 2)
            return
        child.started = time.monotonic()
        child.state = "running"
        log.info("%s started (pid %d)", child.name, child.proc.pid)

    def _start_worker(self, wid: str) -> None:
        child = self.workers[wid]
        self._start(child, ["--generation", str(child.restarts)])

    def _reap(self, child: Child, is_worker: bool) -> None:
        if child.state != "running" or child.proc is None:
            return
        code = child.proc.poll()
        if code is None:
            return
        child.last_exit = code
        now = time.monotonic()
        if now - child.started > STABLE_AFTER:
            child.backoff = BACKOFF_START
        if self.stopping:
            child.state = "stopped"
            return
        if is_worker and child.reloading and code in (contract.EXIT_OK, contract.EXIT_RESTART):
            child.reloading = False
            log.info("%s stopped for the reload; starting it on %s", child.name, self.cfg.model)
            child.restarts += 1
            child.state, child.next_start = "backoff", now
            return
        child.reloading = False
        if not is_worker and code in (contract.EXIT_USAGE, contract.EXIT_CONFIG):
            log.error("%s cannot start (exit %d: an endpoint or port is in use or refused); stopping", child.name, code)
            child.state = "down"
        elif is_worker and code == contract.EXIT_RESTART:
            log.info("%s drained for a restart; starting it again", child.name)
            child.restarts += 1
            child.state, child.next_start = "backoff", now
        elif is_worker and code == contract.EXIT_OK:
            log.info("%s drained and left; it stays down (laya-pool restart-worker %s brings it back)", child.name,
                     child.name.split()[-1])
            child.state = "down"
        elif (is_worker and code == contract.EXIT_CONFIG and self.reload is not None
              and self.reload.current == child.name.split()[-1]):
            child.state = "down"
            self._abort_reload(f"{child.name} cannot load it (exit {code})")
        elif is_worker and code == contract.EXIT_CONFIG:
            log.error("%s cannot serve this model or configuration (exit %d); not restarting it", child.name, code)
            child.state = "down"
        else:
            how = f"signal {-code}" if code < 0 else f"code {code}"
            log.warning("%s (pid %d) died (%s); restarting in %.1f s", child.name, child.proc.pid, how,
                        child.backoff)
            child.restarts += 1
            child.state, child.next_start = "backoff", now + child.backoff
            child.backoff = min(BACKOFF_MAX, child.backoff * 2)

    def _restart_due(self) -> None:
        now = time.monotonic()
        for child in self._singles():
            if child.state == "backoff" and now >= child.next_start:
                self._start(child)
        for wid, child in self.workers.items():
            if child.state == "backoff" and now >= child.next_start:
                self._start_worker(wid)

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
                self._start_worker(wid)
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
            _set_flag(child.argv, "--model", model)
        if fingerprint:
            _set_flag(self.broker.argv, "--fingerprint", fingerprint)

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
            child.restarts += 1
            child.state, child.next_start = "backoff", time.monotonic()
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
        self._start(self.broker)
        for wid in self.workers:
            self._start_worker(wid)
        if self.gateway is not None:
            self._start(self.gateway)
        try:
            while not self.stopping:
                for child in self._singles():
                    self._reap(child, False)
                down = next((c for c in self._singles() if c.state == "down"), None)
                if down is not None:
                    self._shutdown()
                    return down.last_exit or contract.EXIT_CONFIG
                for child in self.workers.values():
                    self._reap(child, True)
                if all(c.state == "down" and c.last_exit == contract.EXIT_CONFIG for c in self.workers.values()):
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
                "worker_restarts": {wid: c.restarts for wid, c in self.workers.items()}}

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
                self._kill(g, "the gateway")
        live = [c for c in self.workers.values() if c.proc is not None and c.proc.poll() is None]
        for c in live:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.drain_timeout
        for c in live:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # Its compute is hung (the watchdog may be 30 s away) or it is stuck elsewhere: a stop must not
                # wait on it. The broker, stopped next, fails what this worker held as retryable.
                log.warning("%s (pid %d) did not leave within %g s of being told to stop; killing it (SIGKILL)",
                            c.name, c.proc.pid, self.cfg.drain_timeout)
                self._kill(c.proc, c.name)
            if c.proc.returncode not in (0, None):
                log.warning("%s exited with code %s while stopping", c.name, c.proc.returncode)
        b = self.broker.proc
        if b is not None and b.poll() is None:
            b.send_signal(signal.SIGTERM)
            try:
                b.wait(BROKER_STOP_S)
            except subprocess.TimeoutExpired:
                log.warning("the broker (pid %d) did not stop within %g s; killing it (SIGKILL)", b.pid, BROKER_STOP_S)
                self._kill(b, "the broker")
        log.info("pool stopped")

    @staticmethod
    def _kill(proc: subprocess.Popen, name: str) -> None:
        proc.kill()
        try:
            proc.wait(KILLED_WAIT_S)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) survives SIGKILL (stuck in the kernel, a driver call?); leaving it", name, proc.pid)
