"""Replies the broker has handed ZeroMQ for clients that have not taken them yet: bounded in total, not per client.

A client that never reads keeps its replies in the broker: first in its connection's kernel buffers (not the
broker's memory), then in ZeroMQ's queue for it, up to `--client-hwm` messages. Per client that bound is a count;
fifty clients that never read held 106 MB of STATUS replies in a broker (issue #54). So `Unread` counts every reply's
bytes (and what holding a message costs besides, `MESSAGE_COST`) until ZeroMQ has let go of it.

ZeroMQ says so through a tracker on a message, and a tracked send costs ~20 us (pyzmq's garbage-collector thread
wakes for it) where a plain one costs under 1 us: so one reply to a client in `SAMPLE_S` carries a tracker (a mark),
and when ZeroMQ lets go of a marked reply every reply sent to that client before it is counted off too (one client's
queue is written in order). What was sent after a client's last mark is counted off once no reply went to it for
`SAMPLE_S` and its marks are all let go of: it reads.

The rule (`admit`): a reply goes while the total stays within `max_bytes`; beyond it, not to a client holding a
marked reply it has not taken for `GRACE_S` (it is not reading), so a client that reads is never refused because
others do not.

"Not taken for `GRACE_S`" is judged on what pyzmq has reported, and pyzmq reports late: ZeroMQ's I/O thread hands each
let-go to pyzmq's garbage-collector thread, in order, and that thread needs the GIL to mark the tracker done. Beside a
thread busy with Python that took ~95 ms (development CPU; ~0.1 ms idle), longer than `GRACE_S`: judged on the clock,
a reading client could look like one that does not read, and its reply was dropped (it came by the client's retry, a
quarter of its timeout later). So the broker makes a *probe* every `PROBE_S` (`probe()`: a tracked message let go of
at once, whose report queues behind every let-go before it) and judges a mark only once a probe made `GRACE_S` or more
after it has been reported: had that client's reply been let go within `GRACE_S`, its report came first. While the
reports run late nobody is judged. The total is therefore at most `max_bytes` plus what reading clients have in
flight and what the others were sent in their last `GRACE_S` and the reports' delay.

What a client that left held is counted off once ZeroMQ drops its queue, and once the total fell 1 MiB below its
high-water mark `trim()` hands the freed heap back to the system (glibc keeps it otherwise: a broker stayed at 129.5 MB
after its fifty non-reading clients left).

Pure bookkeeping over anything with a `done` attribute (zmq.MessageTracker) and the caller's clock (`probe()` aside), so
tests/test_broker_memory.py checks the rule from a table with fakes; broker/sockets.py sends, the broker's housekeeping
settles and trims.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
from dataclasses import dataclass, field
from typing import Any

import zmq

# What holding one message costs beyond its bytes: ZeroMQ's message structures and the allocator's rounding (~270 B a
# held reply, development CPU). Counted with every message, so the bound is one on memory, not on payload.
MESSAGE_COST = 512
SAMPLE_S = 0.025            # a client's replies carry a tracker at most this often
GRACE_S = 0.05              # a marked reply still not taken this long after it went: its client is not reading
TRIM_EVERY_S = 1.0          # at most one malloc_trim a second (it walks the heap: ~1 ms for a broker's)
TRIM_BYTES = 1 << 20        # ... once the unread total fell this far below its high-water mark
PROBE_S = 0.005             # a probe at most this often (~12 us each: 0.2% of a busy broker's time)
PROBES_MAX = 64             # probes not yet reported kept at most (the oldest go first: a later one reports for them)
_PROBE = b"\0" * 8


@dataclass
class _Client:
    sent: int = 0               # bytes counted for it so far (all replies, each with MESSAGE_COST)
    taken: int = 0              # ... of which ZeroMQ let go
    marks: collections.deque = field(default_factory=collections.deque)    # (tracker, `sent` with it, when)
    last_send: float = float("-inf")
    last_mark: float = float("-inf")


class Unread:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.total = 0
        self.clients: dict[bytes, _Client] = {}
        self.peak = 0               # the highest total since the last trim
        self.trimmed_at = float("-inf")
        self.probes: collections.deque = collections.deque(maxlen=PROBES_MAX)   # (tracker, when made)
        self.last_probe = float("-inf")
        self.reported = float("-inf")   # when the newest reported probe was made: every let-go before it is reported

    def admit(self, peer: bytes, n: int, now: float) -> bool:
        """Whether a reply of `n` bytes to `peer` may go now (see the module's rule)."""
        c = self.clients.get(peer)
        if c is None:
            return True
        self._reports()
        self._settle(peer, c, now)
        if self.total + n + MESSAGE_COST <= self.max_bytes:
            return True
        return not c.marks or c.marks[0][2] + GRACE_S > self.reported

    def probe_due(self, now: float) -> bool:
        """Whether to make a probe now (`probe()`, handed to `probed`)."""
        return now - self.last_probe >= PROBE_S

    def probed(self, tracker: Any, now: float) -> None:
        self.probes.append((tracker, now))
        self.last_probe = now

    def mark_due(self, peer: bytes, now: float) -> bool:
        """Whether the next reply to `peer` should carry a tracker."""
        c = self.clients.get(peer)
        return c is None or now - c.last_mark >= SAMPLE_S

    def add(self, peer: bytes, n: int, now: float, tracker: Any = None) -> None:
        """A reply of `n` bytes went to `peer`, with a tracker or without."""
        c = self.clients.get(peer)
        if c is None:
            c = self.clients[peer] = _Client()
        n += MESSAGE_COST
        c.sent += n
        c.last_send = now
        self.total += n
        self.peak = max(self.peak, self.total)
        if tracker is not None:
            c.marks.append((tracker, c.sent, now))
            c.last_mark = now

    def settle(self, now: float) -> None:
        """Count off what ZeroMQ let go of, every client's (housekeeping)."""
        self._reports()
        for peer, c in list(self.clients.items()):
            self._settle(peer, c, now)

    def held(self, peer: bytes) -> int:
        c = self.clients.get(peer)
        return 0 if c is None else c.sent - c.taken

    def trim_due(self, now: float) -> bool:
        """Whether what clients held has gone (they read it or left) and the heap should be trimmed now; if so, the
        high-water mark starts again from here."""
        if self.peak - self.total < TRIM_BYTES or now - self.trimmed_at < TRIM_EVERY_S:
            return False
        self.peak, self.trimmed_at = self.total, now
        return True

    def _reports(self) -> None:
        # Before any client's marks are read: a probe seen done means the let-go reports queued before it are in.
        while self.probes and self.probes[0][0].done:
            self.reported = max(self.reported, self.probes.popleft()[1])

    def _settle(self, peer: bytes, c: _Client, now: float) -> None:
        taken = c.taken
        while c.marks and c.marks[0][0].done:
            taken = c.marks.popleft()[1]
        if not c.marks and now - c.last_send >= SAMPLE_S:
            taken = c.sent                  # quiet, and all it was marked for taken: it reads
        self.total -= taken - c.taken
        c.taken = taken
        if c.taken == c.sent and not c.marks:
            del self.clients[peer]


def probe() -> zmq.MessageTracker:
    """A tracker whose message is let go of now: done once pyzmq has reported every let-go before it."""
    frame = zmq.Frame(_PROBE, track=True, copy=False)      # not copied: a copied frame's tracker is done at once
    tracker = frame.tracker
    del frame                                               # its message is closed here, its report queued
    return tracker


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
