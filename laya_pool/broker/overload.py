"""How long a client turned away as "busy" should wait: the queue's depth over its recent drain rate.

Pure arithmetic, no sockets and no clocks (the broker passes `now`), so it is tested with made-up times.

The hint is the time the pool needs to work off the queue as it stands, at the rate it has been dispatching
lately: a client that comes back then finds room, and clients told the same hint (spread by their own jitter)
do not all knock again while the queue is still full. It is bounded: never below `RETRY_AFTER_MIN_S` (a
queue draining fast still needs a moment), never above `RETRY_AFTER_MAX_S` (a queue that is not draining at
all, with no worker or a stalled one, is worth a look every few seconds: a worker may come back).
"""
from __future__ import annotations

from laya_pool.protocol.contract import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S


class DrainRate:
    """Requests leaving the queue per second, over the last `window_s`: counts in `slots` time slots, so the
    memory is fixed and a burst long ago no longer counts."""

    def __init__(self, window_s: float = 5.0, slots: int = 10):
        self.slot_s = window_s / slots
        self.counts = [0] * slots
        self.current = 0          # the absolute slot number `counts[current % slots]` holds
        self.first: float | None = None

    def note(self, now: float, n: int = 1) -> None:
        """`n` requests left the queue at `now`."""
        self._advance(now)
        self.counts[self.current % len(self.counts)] += n

    def rate(self, now: float) -> float:
        """Requests per second over the window (or over the time since the first one, if shorter)."""
        self._advance(now)
        if self.first is None:
            return 0.0
        window = self.slot_s * len(self.counts)
        span = min(window, max(now - self.first, self.slot_s))
        return sum(self.counts) / span

    def _advance(self, now: float) -> None:
        if self.first is None:
            self.first = now
        slot = int(now / self.slot_s)
        if slot <= self.current:
            return
        for s in range(self.current + 1, min(slot, self.current + len(self.counts)) + 1):
            self.counts[s % len(self.counts)] = 0
        self.current = slot


def retry_after(queued: int, rate: float) -> float:
    """Seconds a busy client should wait: `queued` requests at `rate` per second, within the bounds."""
    if rate <= 0:
        return RETRY_AFTER_MAX_S
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, queued / rate))
