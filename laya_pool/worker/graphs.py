"""GraphCache: CUDA graphs per shape bucket, bounded by entry count and by the bytes they really hold.

The policy (`CacheLedger`) is a plain LRU over (key, bytes) with no CUDA in it, so it can be tested on
its own; `GraphCache` puts captured graphs behind it. An entry's bytes are its private memory pool's
segments as the caching allocator lists them, and evicting it destroys the graph and its pool and
gives the segments back to the driver.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

MISSED_KEPT = 256      # distinct missed buckets `GraphCache.missed` counts (the bucket rule makes far fewer)


@dataclass(frozen=True)
class CachePolicy:
    max_entries: int = 64
    max_bytes: int = 8 << 30

    @property
    def disabled(self) -> bool:
        return self.max_entries <= 0 or self.max_bytes <= 0


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    captures: int = 0
    evictions: int = 0
    fallbacks: int = 0          # requests that ran eager because their bucket cannot be cached
    oversized: int = 0          # buckets whose graph alone exceeded the byte budget
    capture_failures: int = 0
    bytes_held: int = 0
    bytes_returned: int = 0     # measured on eviction
    request_path_captures: int = 0   # captures a request waited for (capture="inline"); 0 in steady traffic
    covered: int = 0            # misses served by a larger captured bucket (same bits: the forward is batch-invariant)
    deferred: int = 0           # misses whose bucket was queued for an idle-time capture
    idle_captures: int = 0      # captures done while no request was waiting


class Bucket(Protocol):
    rows: int
    row_len: int
    row_markers: int


def holds(outer: Bucket, inner: Bucket) -> bool:
    return outer.rows >= inner.rows and outer.row_len >= inner.row_len and outer.row_markers >= inner.row_markers


def smallest_cover(shape: Bucket, held: Iterable[Bucket]) -> Bucket | None:
    """The held bucket that holds `shape` at the least padded work (rows x row length, then markers), or None.

    Running a request padded into a larger bucket gives the same bits as its own bucket (the forward is
    batch- and padding-invariant: docs/decisions/0003-our-gemms-cublas-where-proven.md), so a miss can be served
    by a graph already captured instead of waiting for a capture or running eager."""
    fits = [b for b in held if holds(b, shape)]
    return min(fits, key=lambda b: (b.rows * b.row_len, b.rows, b.row_markers), default=None)


class CacheLedger:
    """LRU bookkeeping: which keys are held, how many bytes, and what must go to admit a new one."""

    def __init__(self, policy: CachePolicy):
        self.policy = policy
        self.entries: OrderedDict[Hashable, int] = OrderedDict()

    @property
    def bytes_held(self) -> int:
        return sum(self.entries.values())

    def touch(self, key: Hashable) -> bool:
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        return False

    def plan_admit(self, nbytes: int) -> list[Hashable] | None:
        """Keys to evict (oldest first) so an entry of `nbytes` fits; None if it can never fit."""
        p = self.policy
        if p.disabled or nbytes > p.max_bytes:
            return None
        victims, held, count = [], self.bytes_held, len(self.entries)
        for key, size in self.entries.items():
            if held + nbytes <= p.max_bytes and count + 1 <= p.max_entries:
                break
            victims.append(key)
            held -= size
            count -= 1
        return victims

    def admit(self, key: Hashable, nbytes: int) -> None:
        self.entries[key] = nbytes

    def remove(self, key: Hashable) -> int:
        return self.entries.pop(key)


@dataclass
class GraphEntry:
    graph: Any
    outputs: tuple
    pool: Any
    nbytes: int
    replays: int = 0
    extra: dict = field(default_factory=dict)


class GraphCache:
    """Captured graphs behind a `CacheLedger`. `capture(key)` must return a GraphEntry with measured bytes."""

    def __init__(self, policy: CachePolicy, capture: Callable[[Hashable], GraphEntry],
                 release: Callable[[GraphEntry], int]):
        self.ledger = CacheLedger(policy)
        self.counters = CacheCounters()
        self._capture, self._release = capture, release
        self.graphs: dict[Hashable, GraphEntry] = {}
        self.uncacheable: set[Hashable] = set()   # oversized or failed: run eager, never re-capture
        self.last_error: str | None = None          # the last failed capture, for status and the log
        self.pending: dict[Hashable, None] = {}     # missed buckets waiting for an idle-time capture, in order
        # Every bucket traffic missed and how often, kept after its capture: what an operator's warm-up could name.
        self.missed: dict[Hashable, int] = {}

    @property
    def policy(self) -> CachePolicy:
        return self.ledger.policy

    def get(self, key: Hashable) -> GraphEntry | None:
        """The graph held for `key` (counted as a hit), or None; never captures."""
        if self.ledger.touch(key):
            self.counters.hits += 1
            return self.graphs[key]
        return None

    def use(self, key: Hashable) -> GraphEntry:
        """A held graph run for a bucket it holds (not counted as a hit: the caller counts it as covered)."""
        self.ledger.touch(key)
        return self.graphs[key]

    def _miss(self, key: Hashable) -> None:
        self.counters.misses += 1
        if key in self.missed or len(self.missed) < MISSED_KEPT:
            self.missed[key] = self.missed.get(key, 0) + 1

    def defer(self, key: Hashable) -> bool:
        """Count a miss and queue `key` for `capture_pending`; False if it can never be cached."""
        self._miss(key)
        if self.policy.disabled or key in self.uncacheable:
            return False
        if key not in self.pending:
            self.counters.deferred += 1
            self.pending[key] = None
        return True

    def capture_pending(self) -> Hashable | None:
        """Capture the oldest deferred bucket (the caller knows no request waits); the key, or None if none."""
        while self.pending:
            key = next(iter(self.pending))
            del self.pending[key]
            if key in self.graphs or key in self.uncacheable:
                continue
            if self.lookup(key, count=False) is not None:
                self.counters.idle_captures += 1
            return key
        return None

    def lookup(self, key: Hashable, count: bool = True) -> GraphEntry | None:
        """The graph for `key`, capturing it on a miss; None means: run this request eager.
        `count=False`: a warm-up or idle-time capture, not a request's."""
        c = self.counters
        if self.ledger.touch(key):
            if count:
                c.hits += 1
            return self.graphs[key]
        if count:
            self._miss(key)
        if self.policy.disabled or key in self.uncacheable:
            if count:
                c.fallbacks += 1
            return None
        if count:
            c.request_path_captures += 1     # a request waits for this capture, captured or not
        try:
            entry = self._capture(key)
        except Exception as e:
            self.last_error = f"{key}: {type(e).__name__}: {e}"
            c.capture_failures += 1
            self.uncacheable.add(key)
            if count:
                c.fallbacks += 1
            return None
        victims = self.ledger.plan_admit(entry.nbytes)
        if victims is None:
            # Larger than the whole budget: it was only captured to learn its size.
            self._release(entry)
            c.oversized += 1
            self.uncacheable.add(key)
            if count:
                c.fallbacks += 1
            return None
        for victim in victims:
            self.evict(victim)
        c.captures += 1
        self.ledger.admit(key, entry.nbytes)
        self.graphs[key] = entry
        c.bytes_held = self.ledger.bytes_held
        return entry

    def evict(self, key: Hashable) -> int:
        self.ledger.remove(key)
        entry = self.graphs.pop(key)
        returned = self._release(entry)
        self.counters.evictions += 1
        self.counters.bytes_returned += returned
        self.counters.bytes_held = self.ledger.bytes_held
        return returned

    def clear(self) -> None:
        for key in list(self.graphs):
            self.evict(key)

    def keys(self) -> list[Hashable]:
        return list(self.ledger.entries)
