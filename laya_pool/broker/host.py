"""A worker host's health and metrics, for `laya-pool workers --http` (served by broker/ops_http.py).

The pool's own metrics (requests, latency, queue, every worker's counters) come from its broker (`laya-pool broker
--http`, or `up --http`), which hears every worker. A worker host says what only it knows: which of its worker
processes the broker has (each worker's own word: protocol/presence.py), which are starting, waiting out a backoff
or down, and how often it restarted them. Ready means every worker meant to run (not taken out by a drain or a
configuration error) is registered with the broker: an orchestrator rolling a new version over the hosts waits for
it before it moves on.

Pure logic: the supervisor hands over a `HostView` (taken once a round in its own thread), this turns it into
readiness and metric families.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from laya_pool.protocol import presence

from .observe import PREFIX

# A worker's state on its host: what it said (protocol/presence.py), or where its process is.
STARTING = "starting"          # running, has not said anything yet (loading the model, warming up)
STATES = (presence.REGISTERED, presence.CONNECTING, presence.DRAINING, STARTING, "backoff", "down", "stopped")
OUT = ("down", "stopped")      # not meant to run: drained by an operator, a configuration error, or the host stopping


@dataclass
class HostView:
    """One round's snapshot of this host's workers."""
    states: dict[str, str] = field(default_factory=dict)       # worker id -> state (STATES)
    devices: dict[str, str] = field(default_factory=dict)      # worker id -> device
    restarts: dict[str, int] = field(default_factory=dict)     # worker id -> times started again
    stopping: bool = False


def readiness(view: HostView) -> tuple[bool, dict]:
    """(ready, body): every worker meant to run is registered with the broker, and there is one."""
    meant = {w: s for w, s in view.states.items() if s not in OUT}
    registered = sum(1 for s in meant.values() if s == presence.REGISTERED)
    body = {"ready": False, "registered_workers": registered, "workers": dict(view.states)}
    if view.stopping:
        body["why"] = "this host's workers are stopping"
    elif not meant:
        body["why"] = "no worker of this host can run (drained, or a configuration error: the log says which)"
    elif registered < len(meant):
        waiting = sorted(w for w, s in meant.items() if s != presence.REGISTERED)
        body["why"] = f"not registered with the broker yet: {', '.join(waiting)}"
    else:
        body["ready"] = True
    return body["ready"], body


class HostObserver:
    """The latest `HostView` (the supervisor's thread sets it, the HTTP thread reads it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.view = HostView()

    def update(self, view: HostView) -> None:
        with self.lock:
            self.view = view

    def readiness(self, now: float) -> tuple[bool, dict]:
        with self.lock:
            return readiness(self.view)

    def families(self, now: float) -> list[Metric]:
        with self.lock:
            return list(_families(self.view))


def _families(view: HostView) -> Iterator[Metric]:
    by_state = {s: 0 for s in STATES}
    for s in view.states.values():
        by_state[s] = by_state.get(s, 0) + 1
    fam = GaugeMetricFamily(PREFIX + "host_workers", "this host's workers by state: registered (the broker has it), "
                            "connecting, starting, draining, backoff (waiting to be started again), down, stopped",
                            labels=["state"])
    for s, n in by_state.items():
        fam.add_metric([s], n)
    yield fam
    fam = GaugeMetricFamily(PREFIX + "host_worker_registered", "1 when the broker has this worker (its own word)",
                            labels=["worker", "device"])
    for w, s in view.states.items():
        fam.add_metric([w, view.devices.get(w, "?")], float(s == presence.REGISTERED))
    yield fam
    fam = CounterMetricFamily(PREFIX + "worker_restarts", "times the supervisor started a worker again (crash, drain "
                              "for a restart, restart-worker)", labels=["worker"])
    for w, n in view.restarts.items():
        fam.add_metric([w], n)
    yield fam
    yield GaugeMetricFamily(PREFIX + "host_stopping", "1 while this host's workers are stopping",
                            value=float(view.stopping))
