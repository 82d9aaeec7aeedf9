"""What the broker measures for the operations surface: request outcomes, work per worker, timings.

Pure bookkeeping, no sockets and no clocks: the broker calls it where a request is refused, dispatched, taken
back or answered, and ships `snapshot()` in its status reply under "meter". Every number only grows while this
broker process lives; the supervisor turns snapshots into totals that survive broker restarts (broker/observe.py).

Histograms (protocol/histogram.py) are kept here for what the broker routes: a status snapshot every second could
not rebuild per-request timings. What clients send the workers directly the workers time themselves (their stats'
`answer_seconds`).
"""
from __future__ import annotations

import collections
from typing import Any

from laya_pool.protocol.histogram import SECONDS_BOUNDS, Histogram

# Requests per merged group: `--max-batch` is 32 on CUDA by default.
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64)

TIMINGS = ("queue_seconds", "worker_seconds", "compute_seconds", "request_seconds")


class Meter:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()   # (status, reason)
        self.workers: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.timings = {name: Histogram(SECONDS_BOUNDS) for name in TIMINGS}
        self.batch: dict[str, Histogram] = {}          # per worker: requests in the group a request ran in
        self.expired_by: collections.Counter[str] = collections.Counter()   # "queue" | "worker"

    def refused(self, status: str, reason: str | None) -> None:
        """The broker itself answered a request with an error (busy, queue-timeout, workers-lost, malformed…)."""
        self.outcomes[(status, reason or "")] += 1

    def expired(self, where: str) -> None:
        """A request (or describe call) dropped unrun because its caller's deadline passed: while it waited in
        the broker's "queue", or in a "worker" that skipped it before compute. (Its answer, if any, is counted
        by `refused` as well, under its reason.)"""
        self.expired_by[where] += 1

    def dispatched(self, waited_s: float) -> None:
        """A request left the broker's queue for a worker after `waited_s` (per dispatch: a re-sent request
        waits again)."""
        self.timings["queue_seconds"].observe(waited_s)

    def requeued(self, worker: str | None, lost: bool) -> None:
        """A request taken back from `worker` and queued again: the worker was lost, or handed it back."""
        self.workers[worker or "?"]["worker-lost" if lost else "handed-back"] += 1

    def answered(self, worker: str, status: str, reason: str | None, rows: int, tokens: int, request_s: float,
                 worker_s: float, metrics: dict[str, Any]) -> None:
        """A worker's final answer (ok, or a refusal) on its way to the client.

        `request_s`: from the request's arrival at the broker; `worker_s`: from its last dispatch;
        `metrics`: the worker's reply metrics (`total_ms` of the forward its group ran in, `batched`)."""
        self.outcomes[(status, reason or "")] += 1
        w = self.workers[worker]
        w[status] += 1
        w["rows"] += rows
        w["tokens"] += tokens
        self.timings["request_seconds"].observe(request_s)
        self.timings["worker_seconds"].observe(worker_s)
        total_ms = metrics.get("total_ms")
        if isinstance(total_ms, (int, float)) and not isinstance(total_ms, bool):
            self.timings["compute_seconds"].observe(total_ms / 1e3)
        batched = metrics.get("batched")
        if isinstance(batched, int) and not isinstance(batched, bool):
            self.batch.setdefault(worker, Histogram(BATCH_BOUNDS)).observe(batched)

    def snapshot(self) -> dict[str, Any]:
        """Plain lists and dicts with string keys (the status travels as msgpack and prints as JSON)."""
        return {"outcomes": [[s, r, n] for (s, r), n in sorted(self.outcomes.items())],
                "workers": {w: dict(c) for w, c in self.workers.items()},
                "timings": {name: h.snapshot() for name, h in self.timings.items()},
                "batch": {w: h.snapshot() for w, h in self.batch.items()},
                "expired": dict(self.expired_by)}
