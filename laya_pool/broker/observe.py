"""Status snapshots -> Prometheus metrics and readiness, for `laya-pool up --http` and `laya-pool broker --http` (served
by broker/ops_http.py).

Pure logic: no sockets, no clocks (callers pass `now`), so it is tested with hand-made snapshots.

Why totals are accumulated here: every counter in a status snapshot starts again at zero somewhere. The broker's
counters and meter die with the broker process (the supervisor restarts it), a worker's own stats die with the
worker process. Prometheus' rate() copes with one reset per series, but a scrape that misses the reset (or a
worker whose counts are summed with others) would make totals jump backwards. So the supervisor, which outlives
both, keeps one running total per series: it adds the difference from the previous snapshot of the same *epoch*
(the broker's pid for broker counts, the worker's pid for worker stats) and the whole value when the epoch
changed or the value went down. What a process counted after the last poll (at most one poll interval, ~1 s)
before it died is lost; totals never go backwards.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

PREFIX = "laya_pool_"
READY = "ready"

# Worker stats (from the worker process, in its heartbeats) exported as counters.
WORKER_ERRORS = ("request_errors", "internal_errors", "upload_errors", "protocol_errors", "handed_back", "dropped",
                 "expired")
# How a worker's data thread took its requests (stats keys -> the `path` label): clients' own, on the direct socket or
# on a lane (docs/architecture.md, "The data path"), and those the I/O thread handed over; the rest came on its data
# socket from the broker.
WORKER_PATHS = {"direct": "direct", "lanes": "lane", "via_control": "control"}
GRAPH_CACHE_EVENTS = ("hits", "misses", "captures", "evictions", "fallbacks", "oversized", "capture_failures",
                      "request_path_captures", "covered", "deferred", "idle_captures")

Key = tuple[str, tuple[tuple[str, str], ...]]


class Observer(Protocol):
    """What broker/ops_http.py serves: a pool's (`PoolObserver`) or a worker host's (broker/host.py `HostObserver`)."""

    def readiness(self, now: float) -> tuple[bool, dict]: ...

    def families(self, now: float) -> list[Metric]: ...


class Totals:
    """Monotonic totals fed with counters that restart from zero (see the module docstring)."""

    def __init__(self) -> None:
        self.total: dict[Key, float] = {}
        self.seen: dict[Key, tuple[Hashable, float]] = {}

    def feed(self, name: str, labels: dict[str, str], epoch: Hashable, value: Any) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return
        key = (name, tuple(sorted(labels.items())))
        prev = self.seen.get(key)
        fresh = prev is None or prev[0] != epoch or value < prev[1]
        self.total[key] = self.total.get(key, 0) + (value if fresh else value - prev[1])
        self.seen[key] = (epoch, value)

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [(dict(labels), v) for (n, labels), v in sorted(self.total.items()) if n == name]


def _num(x: Any, default: float = 0.0) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else default


def readiness(status: dict[str, Any] | None, age_s: float, stale_after_s: float, stopping: bool) -> tuple[bool, dict]:
    """(ready, body): ready when the latest status is fresh and at least one worker is ready."""
    if stopping:
        return False, {"ready": False, "why": "the pool is stopping"}
    if status is None:
        return False, {"ready": False, "why": "no status from the broker yet"}
    if age_s > stale_after_s:
        return False, {"ready": False, "why": f"no status from the broker for {age_s:.1f} s"}
    states = {str(w.get("id")): str(w.get("state")) for w in status.get("workers", [])}
    n = sum(1 for s in states.values() if s == READY)
    body = {"ready": n > 0, "ready_workers": n, "workers": states}
    if n == 0:
        body["why"] = "no worker is ready" if states else "no worker has registered"
    return n > 0, body


class PoolObserver:
    """Latest status + running totals; thread-safe (the supervisor feeds it, the HTTP thread reads it).

    `supervisor_view()` (called at scrape time) returns {"stopping": bool, "broker_restarts": int,
    "worker_restarts": {id: int}}: restarts are counted by the supervisor itself, which never restarts."""

    def __init__(self, supervisor_view: Callable[[], dict[str, Any]] | None = None, stale_after_s: float = 5.0):
        self.view = supervisor_view or (lambda: {})
        self.stale_after_s = stale_after_s
        self.lock = threading.Lock()
        self.totals = Totals()
        self.status: dict[str, Any] | None = None
        self.updated = 0.0
        self.histograms: dict[str, tuple[dict[str, str], list[float]]] = {}   # name|labels -> bounds

    # ------------------------------------------------------------------------------------------------ feeding

    def update(self, status: dict[str, Any], now: float) -> None:
        with self.lock:
            self.status, self.updated = status, now
            broker = status.get("broker", {})
            epoch = ("broker", broker.get("pid"))
            t = self.totals
            counters = broker.get("counters", {})
            t.feed("request_messages", {}, epoch, counters.get("requests", 0))
            t.feed("retries", {"answer": "cache"}, epoch, counters.get("cache_hits", 0))
            t.feed("retries", {"answer": "joined"}, epoch, counters.get("retries_joined", 0))
            for event, n in counters.items():
                t.feed("broker_events", {"event": str(event)}, epoch, n)
            meter = status.get("meter", {})
            for s, r, n in meter.get("outcomes", []):
                t.feed("requests", {"outcome": str(s), "reason": str(r)}, epoch, n)
            for wid, c in meter.get("workers", {}).items():
                for outcome in ("ok", "final"):
                    t.feed("worker_requests", {"worker": wid, "outcome": outcome}, epoch, c.get(outcome, 0))
                for cause in ("worker-lost", "handed-back"):
                    t.feed("redispatches", {"worker": wid, "cause": cause}, epoch, c.get(cause, 0))
                t.feed("worker_rows", {"worker": wid}, epoch, c.get("rows", 0))
                t.feed("worker_tokens", {"worker": wid}, epoch, c.get("tokens", 0))
            for where, n in meter.get("expired", {}).items():
                t.feed("expired", {"where": str(where)}, epoch, n)
            for name, h in meter.get("timings", {}).items():
                self._feed_histogram(name, {}, epoch, h)
            for wid, h in meter.get("batch", {}).items():
                self._feed_histogram("batch_requests", {"worker": wid}, epoch, h)
            for w in status.get("workers", []):
                self._feed_worker(w)

    def _feed_histogram(self, name: str, labels: dict[str, str], epoch: Hashable, h: dict[str, Any]) -> None:
        bounds, counts = h.get("bounds", []), h.get("counts", [])
        if len(counts) != len(bounds) + 1:
            return
        key = name + repr(sorted(labels.items()))
        self.histograms[key] = (dict(labels, __name__=name), [float(b) for b in bounds])
        for i, n in enumerate(counts):
            self.totals.feed(name + ":bucket", dict(labels, i=str(i)), epoch, n)
        self.totals.feed(name + ":sum", labels, epoch, h.get("sum", 0.0))

    def _feed_worker(self, w: dict[str, Any]) -> None:
        stats = w.get("stats") or {}
        if not stats:          # just registered: its first heartbeat carries them
            return
        wid, epoch = str(w.get("id")), ("worker", w.get("pid"))
        t = self.totals
        # Every path's answers, counted by the worker: requests clients sent it directly or on lanes never reach
        # the broker's meter (worker_requests).
        t.feed("worker_answered", {"worker": wid}, epoch, stats.get("ok"))
        if isinstance(stats.get("answer_seconds"), dict):
            self._feed_histogram("worker_answer_seconds", {"worker": wid}, epoch, stats["answer_seconds"])
        t.feed("worker_merged_runs", {"worker": wid}, epoch, stats.get("merged_runs"))
        t.feed("worker_merged_requests", {"worker": wid}, epoch, stats.get("merged_requests"))
        t.feed("worker_set_aside", {"worker": wid}, epoch, stats.get("set_aside"))
        t.feed("worker_busy_seconds", {"worker": wid}, epoch, stats.get("busy_s"))
        for kind in WORKER_ERRORS:
            t.feed("worker_errors", {"worker": wid, "kind": kind}, epoch, stats.get(kind))
        for key, path in WORKER_PATHS.items():
            t.feed("worker_taken", {"worker": wid, "path": path}, epoch, stats.get(key))
        cache = (stats.get("runtime") or {}).get("cache") or {}
        for event in GRAPH_CACHE_EVENTS:
            t.feed("worker_graph_cache", {"worker": wid, "event": event}, epoch, cache.get(event))

    # ------------------------------------------------------------------------------------------------ reading

    def readiness(self, now: float) -> tuple[bool, dict]:
        stopping = bool(self.view().get("stopping"))
        with self.lock:
            return readiness(self.status, now - self.updated, self.stale_after_s, stopping)

    def families(self, now: float) -> list[Metric]:
        view = self.view()
        with self.lock:
            return list(self._families(now, view))

    def _families(self, now: float, view: dict[str, Any]) -> Iterator[Metric]:
        st = self.status or {}
        yield from self._broker_gauges(now, st.get("broker", {}))
        yield from self._worker_gauges(st.get("workers", []))
        yield from self._counter_families(view)
        yield from self._histogram_families()

    def _broker_gauges(self, now: float, broker: dict[str, Any]) -> Iterator[Metric]:
        fresh = self.status is not None and now - self.updated <= self.stale_after_s
        yield _gauge("broker_up", "1 when the supervisor got the broker's status recently", [({}, float(fresh))])
        yield _gauge("status_age_seconds", "seconds since the supervisor last got the broker's status",
                     [({}, now - self.updated if self.status is not None else float("inf"))])
        for name, key, text in (("queue_depth", "queue", "requests waiting in the broker's queue"),
                                ("queue_capacity", "queue_size", "requests the queue holds before answering busy"),
                                ("drain_rate", "drain_per_s", "requests per second leaving the queue for workers "
                                                              "(last 5 s): what the busy retry-after is based on"),
                                ("queue_bytes", "queue_bytes", "payload bytes of requests queued or running"),
                                ("inflight", "inflight", "requests (and describe calls) held by workers"),
                                ("cached_replies", "cached_replies", "finished replies kept for retries")):
            yield _gauge(name, text, [({}, _num(broker.get(key)))] if broker else [])

    def _worker_gauges(self, workers: list[dict[str, Any]]) -> Iterator[Metric]:
        states: dict[str, int] = {}
        for w in workers:
            states[str(w.get("state"))] = states.get(str(w.get("state")), 0) + 1
        yield _gauge("workers", "workers the broker lists, by state", [({"state": s}, n) for s, n in states.items()])
        per = {"worker_ready": ("1 when the worker is ready for requests", lambda w: float(w.get("state") == READY)),
               "worker_inflight": ("requests the worker holds", lambda w: _num(w.get("inflight"))),
               "worker_credit": ("requests the worker may hold at once", lambda w: _num(w.get("credit"))),
               "worker_graph_cache_bytes": ("device bytes held by the worker's graph cache",
                                            lambda w: _num((((w.get("stats") or {}).get("runtime") or {})
                                                            .get("cache") or {}).get("bytes_held"))),
               "worker_graph_cache_shapes": ("shape buckets with a captured graph",
                                             lambda w: float(len(((w.get("stats") or {}).get("runtime") or {})
                                                                 .get("cached_shapes") or [])))}
        for name, (text, fn) in per.items():
            yield _gauge(name, text, [({"worker": str(w.get("id")), "device": str(w.get("device"))}, fn(w))
                                      for w in workers])

    def _counter_families(self, view: dict[str, Any]) -> Iterator[Metric]:
        t = self.totals
        for name, text in (
                ("requests", "requests answered, by outcome (ok, final, retryable) and reason (empty: ok, or "
                             "refused by a worker's validation)"),
                ("request_messages", "REQUEST messages the broker parsed (each retry again)"),
                ("retries", "retried requests answered without running again: from the reply cache, or joined "
                            "to the attempt still running"),
                ("redispatches", "requests taken back from a worker and queued again (worker-lost: it died, hung "
                                 "or failed running them; handed-back: it was stopping)"),
                ("broker_events", "the broker's own event counters (status broker.counters), by name"),
                ("expired", "requests dropped unrun because their caller's deadline passed, by where (queue: "
                            "waiting in the broker; worker: skipped by a worker before compute)"),
                ("worker_requests", "requests a worker answered, by outcome (ok, final), as the broker saw them"),
                ("worker_answered", "requests a worker answered ok by its own count, whichever way they came (the "
                                    "broker, a client's direct socket, a lane)"),
                ("worker_rows", "question rows a worker answered"),
                ("worker_tokens", "tokens a worker answered"),
                ("worker_merged_runs", "forwards that merged more than one request"),
                ("worker_merged_requests", "requests that ran inside merged forwards"),
                ("worker_set_aside", "times a group set a request aside for a later one (it would have taken the "
                                     "group's padding past --merge-waste tokens)"),
                ("worker_busy_seconds", "seconds a worker had work taken and not yet answered (its device busy, with "
                                        "the host's part of each group): its rate is the worker's busy share"),
                ("worker_errors", "errors inside a worker, by kind"),
                ("worker_taken", "request messages a worker's data thread took other than from the broker's data "
                                 "socket, by path (direct: a client's on the direct socket; lane: a client's through "
                                 "shared memory; control: handed over by the I/O thread)"),
                ("worker_graph_cache", "CUDA graph cache events of a worker (hits, misses, captures, ...)")):
            yield _counter(name, text, t.series(name))
        restarts = view.get("worker_restarts", {})
        yield _counter("worker_restarts", "times the supervisor started a worker again (crash, drain for a "
                                          "restart, restart-worker)", [({"worker": w}, n) for w, n in restarts.items()])
        yield _counter("broker_restarts", "times the supervisor started the broker again",
                       [({}, view["broker_restarts"])] if "broker_restarts" in view else [])

    def _histogram_families(self) -> Iterator[Metric]:
        text = {"queue_seconds": "seconds a request waited in the broker's queue, per dispatch",
                "worker_seconds": "seconds from dispatch to the worker's answer (its queue, the forward, transport)",
                "compute_seconds": "seconds of the forward a request ran in (validate, pack, device, readback; the "
                                   "whole merged group)",
                "request_seconds": "seconds from a request's arrival at the broker to its answer",
                "batch_requests": "requests in the merged group a request ran in",
                "worker_answer_seconds": "seconds from a request's arrival at a worker to its ok answer, whichever "
                                         "way it came (the broker, the worker's direct socket, a lane)"}
        grouped: dict[str, list[tuple[dict[str, str], list[float]]]] = {}
        for labels, bounds in self.histograms.values():
            labels = dict(labels)
            grouped.setdefault(labels.pop("__name__"), []).append((labels, bounds))
        for name in sorted(grouped):
            label_names = sorted(grouped[name][0][0])
            fam = HistogramMetricFamily(PREFIX + name, text.get(name, name), labels=label_names)
            for labels, bounds in grouped[name]:
                counts = [self.totals.total.get((name + ":bucket", tuple(sorted(dict(labels, i=str(i)).items()))), 0)
                          for i in range(len(bounds) + 1)]
                cumulative, acc = [], 0.0
                for bound, n in zip([*(_fmt(b) for b in bounds), "+Inf"], counts):
                    acc += n
                    cumulative.append((bound, acc))
                total_sum = self.totals.total.get((name + ":sum", tuple(sorted(labels.items()))), 0.0)
                fam.add_metric([labels[k] for k in label_names], cumulative, total_sum)
            yield fam


def _fmt(bound: float) -> str:
    return repr(float(bound))


def _family(kind, name: str, text: str, samples: list[tuple[dict[str, str], float]]):
    names = sorted(samples[0][0]) if samples else []
    fam = kind(PREFIX + name, text, labels=names)
    for labels, v in samples:
        fam.add_metric([labels[k] for k in names], v)
    return fam


def _gauge(name: str, text: str, samples: list[tuple[dict[str, str], float]]) -> GaugeMetricFamily:
    return _family(GaugeMetricFamily, name, text, samples)


def _counter(name: str, text: str, samples: list[tuple[dict[str, str], float]]) -> CounterMetricFamily:
    return _family(CounterMetricFamily, name, text, samples)
