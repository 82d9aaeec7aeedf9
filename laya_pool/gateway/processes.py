"""Several gateway processes on one port (`laya-pool api --processes N`).

One gateway process is one Python event loop: on an H100 host it answers at most about 2,300 one-question decisions a
second (docs/performance.md), a quarter of what one GPU's worker computes; eight answered 8,455 from 64 clients. N
processes share the one listening socket, which the parent binds before starting them (so a taken port is still one line
and exit 78); the kernel hands each new connection to one of them. Each has its own pool client, so the workers merge
requests from all of them, and its own bounds: `max_concurrent` and `max_connections` hold per process.

The parent only supervises: a process that exits while the gateway is not stopping is started again after the pool's
one backoff (`Restarts`: 0.5 s, doubling to 30 s; protocol/lifecycle.py), unless it exited because it cannot start
(usage or configuration), which stops the whole gateway with that code. SIGTERM / SIGINT reach every process (each
drains as a lone gateway does); stragglers are killed `drain_timeout` + 5 s later. A process gets SIGTERM when the
parent dies, so none is left holding the port.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from laya_pool.protocol import contract, lifecycle, logs, settings

from .options import GatewayConfig

log = logging.getLogger("laya-pool.gateway")

KILL_GRACE_S = 5.0           # past drain_timeout, before a stopping process is killed
FATAL = (contract.EXIT_USAGE, contract.EXIT_CONFIG)


@dataclass
class Restarts:
    """When one process slot starts its process again, by the pool's one backoff (protocol/lifecycle.py). Pure: the
    caller gives the clock."""
    delay: float = lifecycle.BACKOFF_START
    started_at: float = 0.0
    due_at: float | None = None            # None: running (or not yet started)

    def started(self, now: float) -> None:
        self.started_at, self.due_at = now, None

    def exited(self, now: float) -> float:
        """The process exited at `now`: the delay before its next start (which `due` then answers)."""
        wait = lifecycle.backoff_after(self.delay, now - self.started_at)
        self.delay, self.due_at = lifecycle.next_backoff(wait), now + wait
        return wait

    def due(self, now: float) -> bool:
        return self.due_at is not None and now >= self.due_at


def _die_with(parent: int) -> None:
    """SIGTERM to this process when `parent` dies: a gateway process left alone would hold the port, and `up` could
    not start the gateway again."""
    if lifecycle.die_with_parent() and os.getppid() != parent:      # it died before the call
        os._exit(0)


def _child(cfg: GatewayConfig, sock: socket.socket, index: int, parent: int) -> None:
    """A gateway process (spawned: nothing of the parent but these arguments and the environment)."""
    import sys

    from .server import run
    _die_with(parent)
    logs.setup(f"api-{index}", settings.raw(logs.LEVEL_ENV) or "INFO", settings.raw(logs.FORMAT_ENV) or "text")
    sys.exit(run(cfg, sock))


class GatewayProcesses:
    """`cfg.processes` gateway processes serving `sock`, started again when one exits, until a signal stops them."""

    def __init__(self, cfg: GatewayConfig, sock: socket.socket):
        self.cfg, self.sock = cfg, sock
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = [None] * cfg.processes
        self.restarts = [Restarts() for _ in range(cfg.processes)]
        self.stop = threading.Event()
        self.code = contract.EXIT_OK

    def _start(self, i: int) -> None:
        p = self.ctx.Process(target=_child, args=(self.cfg, self.sock, i, os.getpid()), name=f"laya-pool-api-{i}",
                             daemon=False)
        p.start()
        self.procs[i] = p
        self.restarts[i].started(time.monotonic())

    def _watch(self, i: int, now: float) -> None:
        p, r = self.procs[i], self.restarts[i]
        if r.due(now):
            self._start(i)
        elif p is not None and r.due_at is None and p.exitcode is not None:
            if p.exitcode in FATAL:
                log.error("gateway process %d cannot start (exit %d); stopping", i, p.exitcode)
                self.code = p.exitcode
                self.stop.set()
                return
            wait = r.exited(now)
            log.warning("gateway process %d exited (code %s); starting it again in %.1f s", i, p.exitcode, wait)

    def run(self) -> int:
        """Serve until SIGTERM / SIGINT (or a process that cannot start); the exit code."""
        previous = {s: signal.signal(s, lambda *_: self.stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for i in range(len(self.procs)):
                self._start(i)
            while not self.stop.wait(0.2):
                now = time.monotonic()
                for i in range(len(self.procs)):
                    self._watch(i, now)
        finally:
            self._stop_all()
            for s, h in previous.items():
                signal.signal(s, h)
        return self.code

    def _stop_all(self) -> None:
        alive = [p for p in self.procs if p is not None and p.exitcode is None]
        for p in alive:
            p.terminate()                  # SIGTERM: the process drains as a lone gateway does
        deadline = time.monotonic() + self.cfg.drain_timeout + KILL_GRACE_S
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                log.warning("gateway process %s did not stop in time; killing it", p.name)
                p.kill()
                p.join(5)
