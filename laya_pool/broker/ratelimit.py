"""A pure rate limit for log lines: at most one per cause every interval, and how many were held back.

No clock and no logger of its own (the caller passes `now` and writes the line), so it is tested from a table alone
(tests/test_ratelimit.py). `broker.monitor.LogLimiter` writes the lines of the broker and of the supervisor's HTTP
endpoint through it: a peer that aborts or garbles a thousand requests a second costs one line a second per cause.
"""
from __future__ import annotations

MAX_CAUSES = 256        # causes remembered at once: a caller that made causes from peer input could not grow it


class RateLimit:
    """At most one event per cause every `interval_s` seconds; the events in between are counted, not let through."""

    def __init__(self, interval_s: float):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.last: dict[str, float] = {}          # cause -> when its last event went through
        self.held: dict[str, int] = {}            # cause -> events held back since then

    def admit(self, cause: str, now: float) -> int | None:
        """None: hold this event back (it is counted); else let it through, with the number held back before it."""
        last = self.last.get(cause)
        if last is not None and now - last < self.interval_s:
            self.held[cause] = self.held.get(cause, 0) + 1
            return None
        if last is None and len(self.last) >= MAX_CAUSES:
            self._forget_oldest()
        self.last[cause] = now
        return self.held.pop(cause, 0)

    def due(self, now: float) -> list[tuple[str, int]]:
        """The causes whose held-back events have waited a whole interval with nothing let through, and their counts
        (each then starts afresh): so a count is said even when no later event of its cause comes."""
        out = [(cause, n) for cause, n in self.held.items() if now - self.last[cause] >= self.interval_s]
        for cause, _ in out:
            del self.held[cause]
            self.last[cause] = now
        return out

    def _forget_oldest(self) -> None:
        cause = min(self.last, key=self.last.__getitem__)
        del self.last[cause]
        self.held.pop(cause, None)
