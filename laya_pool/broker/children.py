"""A supervisor's child processes: how one is started, judged when it exits, restarted with backoff, and killed.

Shared by `laya-pool up` (broker/supervisor.py: the broker, the workers, the gateway) and `laya-pool workers`
(broker/remote.py: this host's workers joining a broker on another host); the workers' own rules are in
broker/processes.py. A child is a subprocess started by module name in its own session, which gets SIGTERM when its
supervisor dies (Linux), so nothing is orphaned; a crashed one comes back after the pool's backoff (0.5 s, doubled
per crash up to 30 s, reset once it ran a minute: protocol/lifecycle.py). One that cannot be started at all (out of
file descriptors, processes or memory: EMFILE, EAGAIN, ENOMEM) is logged and tried again with the same backoff, while
the supervisor and the children it has go on.
"""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from laya_pool.protocol import lifecycle, settings

log = logging.getLogger("laya-pool.supervisor")
# Where this package lies (a checkout's root, or site-packages): the children import it from there.
HOME = Path(sys.modules[__name__.split(".")[0]].__file__).resolve().parents[1]
KILLED_WAIT_S = 1.0     # for the kernel to reap a SIGKILLed child; longer means it is stuck in the kernel (D state)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    backoff: float = lifecycle.BACKOFF_START
    next_start: float = 0.0
    state: str = "starting"      # running | backoff | down (drained / config error) | stopped
    last_exit: int | None = None
    operator_start: float = float("-inf")   # when an operator's restart-worker last started it
    reloading: bool = False                  # told to stop for a reload: start it again at once

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


def environment() -> dict[str, str]:
    """The children's environment: this one without the LAYA_* variables nothing declares (the command warned of each
    once; its children read none of them), with a checkout first on PYTHONPATH (an install is found by itself)."""
    env = dict(os.environ)
    for name, _ in settings.undeclared(env):
        del env[name]
    if HOME.name not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = str(HOME) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def set_flag(argv: list[str], flag: str, value: str) -> None:
    """Replace `flag`'s value in a child's command line (append the pair when it is not there)."""
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]


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


def start(child: Child, extra: list[str] | None = None) -> None:
    """Start `child` (`extra`: arguments for this start only); one that cannot be spawned waits out its backoff."""
    try:
        child.proc = subprocess.Popen(child.argv + (extra or []), env=child.env,
                                      preexec_fn=lifecycle.die_with_parent,
                                      start_new_session=True)
    except (OSError, subprocess.SubprocessError) as e:
        # Out of file descriptors, processes or memory (EMFILE, EAGAIN, ENOMEM): what runs keeps running, and this
        # child is tried again with its backoff, as after a crash.
        child.state, child.next_start = "backoff", time.monotonic() + child.backoff
        log.error("could not start %s: %s%s; trying again in %.1f s", child.name, e, _spawn_hint(e), child.backoff)
        child.backoff = lifecycle.next_backoff(child.backoff)
        return
    child.started = time.monotonic()
    child.state = "running"
    log.info("%s started (pid %d)", child.name, child.proc.pid)


def exited(child: Child) -> int | None:
    """The exit code of a running child that has exited (recorded as its `last_exit`), else None."""
    if child.state != "running" or child.proc is None:
        return None
    code = child.proc.poll()
    if code is None:
        return None
    child.last_exit = code
    child.backoff = lifecycle.backoff_after(child.backoff, time.monotonic() - child.started)
    return code


def again(child: Child) -> None:
    """Start it again at once (the supervisor's next round)."""
    child.restarts += 1
    child.state, child.next_start = "backoff", time.monotonic()


def crashed(child: Child) -> None:
    """It died (a crash, a signal): start it again after its backoff, and double the backoff."""
    code = child.last_exit or 0
    how = f"signal {-code}" if code < 0 else f"code {code}"
    log.warning("%s (pid %d) died (%s); restarting in %.1f s", child.name, child.proc.pid, how, child.backoff)
    child.restarts += 1
    child.state, child.next_start = "backoff", time.monotonic() + child.backoff
    child.backoff = lifecycle.next_backoff(child.backoff)


def due(child: Child, now: float) -> bool:
    """Waiting to be started again, and its time has come."""
    return child.state == "backoff" and now >= child.next_start


def kill(proc: subprocess.Popen, name: str) -> None:
    proc.kill()
    try:
        proc.wait(KILLED_WAIT_S)
    except subprocess.TimeoutExpired:
        log.error("%s (pid %d) survives SIGKILL (stuck in the kernel, a driver call?); leaving it", name, proc.pid)
