"""This host's worker processes: what `laya-pool up` (beside its broker) and `laya-pool workers` (joining a broker on
another host) both supervise.

- one worker per device slot (`-m laya_pool.worker.server`), each GPU worker with CUDA_VISIBLE_DEVICES set to its
  GPU, CPU workers pinned to disjoint cores;
- a worker that exits is started again at once when it drained for a restart (exit 75) or was stopped for a reload,
  with exponential backoff after a crash (any other non-zero exit or a signal), never after a configuration error
  (exit 78: the checkpoint is unusable) or a clean drain (exit 0: the operator took it out);
- a stop is a drain: every worker is told (SIGTERM), finishes its in-flight work and leaves; one still there
  `drain_timeout` later is SIGKILLed (a hung device never finishes).

Worker ids are `0`, `1`, ... under `up`, and `NAME-0`, `NAME-1`, ... under `laya-pool workers` (NAME: the host's), so
the workers of several hosts never share an id in their broker's table, and a host's worker keeps its id across
restarts of the process and of its supervisor (the broker then counts it as the same worker coming back).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from laya_pool.protocol import contract, presence

from . import children
from .children import Child

log = logging.getLogger("laya-pool.supervisor")
DRAIN_TIMEOUT = 5.0     # a stopping worker's grace before SIGKILL


@dataclass
class WorkerOptions:
    """What the workers of one host are started with (`up` and `laya-pool workers` take the same options)."""
    model: str
    devices: list[str]
    workers_per_device: int = 1
    heartbeat_ms: int = 1000
    liveness: int = 3
    mode: str | None = None
    credit: int | None = None          # None: each worker picks (twice its merge size)
    keys: str | None = None
    worker_args: list[str] = field(default_factory=list)
    drain_timeout: float = DRAIN_TIMEOUT
    http: str | None = None             # [HOST:]PORT for /metrics and /health; None: off
    worker_secret_file: str | None = None   # the broker's worker secret (None: each worker reads the run directory)


def cpu_sets(devices: list[str], per_device: int) -> list[list[int] | None]:
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


class WorkerProcesses:
    """The workers of one host for the broker at `backend`. `name`: the ids' prefix (None: `0`, `1`, ...);
    `direct`: the --direct-endpoint each worker gets (None: its own default); `presence`: a private directory where
    each worker says whether the broker has it (protocol/presence.py). `on_config_error(id)`: told first when a
    worker exits with a configuration error; True when it took care of it (a reload puts the old model back)."""

    def __init__(self, opts: WorkerOptions, backend: str, env: dict[str, str], *, name: str | None = None,
                 direct: str | None = None, presence_dir: Path | None = None):
        self.opts, self.presence_dir = opts, presence_dir
        slots = [d for d in opts.devices for _ in range(opts.workers_per_device)]
        self.children: dict[str, Child] = {}
        for i, (device, cpus) in enumerate(zip(slots, cpu_sets(opts.devices, opts.workers_per_device))):
            wid = str(i) if name is None else f"{name}-{i}"
            self.children[wid] = self._child(wid, device, cpus, backend, env, direct)
        self.on_config_error: Callable[[str], bool] = lambda wid: False

    def _child(self, wid: str, device: str, cpus: list[int] | None, backend: str, env: dict[str, str],
               direct: str | None) -> Child:
        opts = self.opts
        env = dict(env)
        if device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1] if ":" in device else "0"
        argv = [sys.executable, "-m", "laya_pool.worker.server", "--model", opts.model, "--device", device,
                "--backend", backend, "--id", wid, "--heartbeat-ms", str(opts.heartbeat_ms),
                "--liveness", str(opts.liveness)]
        argv += ["--keys", opts.keys] if opts.keys else []
        if opts.credit is not None:
            argv += ["--credit", str(opts.credit)]
        if opts.mode:
            argv += ["--mode", opts.mode]
        if cpus:
            argv += ["--cpus", ",".join(map(str, cpus))]
        if direct:
            argv += ["--direct-endpoint", direct]
        if self.presence_dir is not None:
            argv += ["--presence-file", str(self.presence_dir / f"{wid}.json")]
        if opts.worker_secret_file:
            argv += ["--worker-secret-file", opts.worker_secret_file]
        return Child(f"worker {wid}", argv + opts.worker_args, env)

    # ------------------------------------------------------------------------------------------------ running

    def start(self, wid: str) -> None:
        child = self.children[wid]
        children.start(child, ["--generation", str(child.restarts)])

    def start_all(self) -> None:
        for wid in self.children:
            self.start(wid)

    def reap(self, stopping: bool) -> None:
        """Judge every worker that exited since the last round (the module's docstring says how)."""
        for wid, child in self.children.items():
            code = children.exited(child)
            if code is None:
                continue
            if stopping:
                child.state = "stopped"
            elif child.reloading and code in (contract.EXIT_OK, contract.EXIT_RESTART):
                child.reloading = False
                log.info("%s stopped for the reload; starting it on %s", child.name, self.opts.model)
                children.again(child)
            else:
                child.reloading = False
                self._exited(wid, child, code)

    def _exited(self, wid: str, child: Child, code: int) -> None:
        if code == contract.EXIT_RESTART:
            log.info("%s drained for a restart; starting it again", child.name)
            children.again(child)
        elif code == contract.EXIT_OK:
            log.info("%s drained and left; it stays down (laya-pool restart-worker %s brings it back)", child.name,
                     wid)
            child.state = "down"
        elif code == contract.EXIT_CONFIG:
            child.state = "down"
            if not self.on_config_error(wid):
                log.error("%s cannot serve this model or configuration (exit %d); not restarting it", child.name,
                          code)
        else:
            children.crashed(child)

    def restart_due(self) -> None:
        now = time.monotonic()
        for wid, child in self.children.items():
            if children.due(child, now):
                self.start(wid)

    def none_can_start(self) -> bool:
        """Every worker is down with a configuration error."""
        return all(c.state == "down" and c.last_exit == contract.EXIT_CONFIG for c in self.children.values())

    def restarts(self) -> dict[str, int]:
        return {wid: c.restarts for wid, c in self.children.items()}

    def states(self) -> dict[str, str]:
        """Each worker's state as this host sees it: what a running worker last said (protocol/presence.py; `starting`
        before it said anything), else its process's state (backoff, down, stopped)."""
        out = {}
        for wid, child in self.children.items():
            if child.state != "running" or child.proc is None or child.proc.poll() is not None:
                out[wid] = child.state
            elif self.presence_dir is None:
                out[wid] = "running"
            else:
                out[wid] = presence.read(self.presence_dir / f"{wid}.json", child.pid) or "starting"
        return out

    # ------------------------------------------------------------------------------------------------ stopping

    def stop(self) -> None:
        """Every worker finishes its in-flight work and leaves; one still there after the drain timeout is killed."""
        live = [c for c in self.children.values() if c.proc is not None and c.proc.poll() is None]
        for c in live:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGTERM)
        timeout = self.opts.drain_timeout
        deadline = time.monotonic() + timeout
        for c in live:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # Its compute is hung (the watchdog may be 30 s away) or it is stuck elsewhere: a stop must not
                # wait on it. Its broker fails what it held as retryable (`up`), or re-sends it to another worker.
                log.warning("%s (pid %d) did not leave within %g s of being told to stop; killing it (SIGKILL)",
                            c.name, c.proc.pid, timeout)
                children.kill(c.proc, c.name)
            if c.proc.returncode not in (0, None):
                log.warning("%s exited with code %s while stopping", c.name, c.proc.returncode)
