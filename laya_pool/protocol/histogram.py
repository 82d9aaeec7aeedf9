"""A histogram of fixed buckets, as the broker's meter and the workers' stats ship them in a status: counts, not
samples, so that a snapshot every second keeps every request's timing (broker/observe.py turns them into
Prometheus histograms). Prometheus' `le` semantics: a value lands in the first bucket whose bound is >= it, the last
bucket holds what is above every bound."""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

# Seconds: from a tiny CPU model (sub-millisecond) to a request that waited out a queue timeout.
SECONDS_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}
