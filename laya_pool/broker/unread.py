"""Replies the broker has handed ZeroMQ for clients that have not taken them yet: bounded in total, not per client.

A client that never reads keeps its replies in the broker: first in its connection's kernel buffers (not the
broker's memory), then in ZeroMQ's queue for it, up to `--client-hwm` messages. Per client that bound is a count;
fifty clients that never read held 106 MB of STATUS replies in a broker (issue #54). So every reply to a client is
sent with a ZeroMQ tracker on its first frame, which says when ZeroMQ let go of the message (written to the
connection, or dropped with it), and `Unread` counts the bytes not let go of yet: in total, and per client.

The rule (`admit`): a reply goes while the total stays within `max_bytes`; beyond it only to a client with nothing
unread (one that reads, or has asked nothing yet), so a hoarder cannot starve the others. The total is therefore at
most `max_bytes` plus one reply per connected client. What a client that left held is counted off once ZeroMQ drops
its queue, and once the total fell 1 MiB below its high-water mark `trim()` hands the freed heap back to the system
(glibc keeps it otherwise: the issue's broker stayed at 129.5 MB after its fifty clients left).

Pure bookkeeping over anything with a `done` attribute (zmq.MessageTracker), so tests/test_broker_memory.py checks the
rule from a table with fakes; broker/sockets.py sends, the broker's housekeeping settles and trims.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
from typing import Any

# What holding one message costs beyond its bytes: its tracker (pyzmq's Frame, MessageTracker and Event, ~1.9 KB of
# Python objects), ZeroMQ's message structures and the allocator's rounding: 5.2 KB of RSS per held 1.2 KB reply
# (development CPU). Counted with every message, so the bound is one on memory, not on payload.
MESSAGE_COST = 4096
TRIM_EVERY_S = 1.0          # at most one malloc_trim a second (it walks the heap: ~1 ms for a broker's)
TRIM_BYTES = 1 << 20        # ... once the unread total fell this far below its high-water mark


class Unread:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.total = 0
        self.peers: dict[bytes, collections.deque[tuple[Any, int]]] = {}   # client -> (tracker, bytes), oldest first
        self.peak = 0               # the highest total since the last trim
        self.trimmed_at = float("-inf")

    def admit(self, peer: bytes, n: int) -> bool:
        """Whether a reply of `n` bytes to `peer` may go now (see the module's rule)."""
        q = self.peers.get(peer)
        if q is not None:
            self._settle(peer, q)
            q = self.peers.get(peer)
        return q is None or self.total + n + MESSAGE_COST <= self.max_bytes

    def add(self, peer: bytes, tracker: Any, n: int) -> None:
        """A reply of `n` bytes went to `peer`; `tracker.done` says when ZeroMQ let go of it."""
        if tracker.done:
            return
        n += MESSAGE_COST
        self.peers.setdefault(peer, collections.deque()).append((tracker, n))
        self.total += n
        self.peak = max(self.peak, self.total)

    def settle(self) -> None:
        """Count off what ZeroMQ let go of, every client's (housekeeping)."""
        for peer, q in list(self.peers.items()):
            self._settle(peer, q)

    def trim_due(self, now: float) -> bool:
        """Whether what clients held has gone (they read it or left) and the heap should be trimmed now; if so, the
        high-water mark starts again from here."""
        if self.peak - self.total < TRIM_BYTES or now - self.trimmed_at < TRIM_EVERY_S:
            return False
        self.peak, self.trimmed_at = self.total, now
        return True

    def held(self, peer: bytes) -> int:
        return sum(n for _, n in self.peers.get(peer, ()))

    def _settle(self, peer: bytes, q: collections.deque[tuple[Any, int]]) -> None:
        while q and q[0][0].done:       # one client's queue is written in order
            self.total -= q.popleft()[1]
        if not q:
            del self.peers[peer]


_LIBC: Any = None


def trim() -> bool:
    """Hand the heap's free memory back to the system (glibc's malloc_trim); False where there is none."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC is False:
        return False
    with contextlib.suppress(Exception):
        _LIBC.malloc_trim(0)
        return True
    return False
