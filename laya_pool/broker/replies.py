"""The broker's reply cache: finished replies kept for retries, bounded in entries, bytes and age.

A client that timed out sends the same (client id, request id) again; a finished request is answered
from here instead of running twice. Pure (no sockets, no clock of its own: the caller passes `now`),
so its limits are tested from a table on their own (tests/test_broker_units.py).
"""
from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from typing import Any


def frames_bytes(frames: Sequence[Any]) -> int:
    return sum(map(len, frames))


class ReplyCache:
    """Oldest first out: an entry leaves when it is older than `ttl_s`, or to make room under
    `max_entries` / `max_bytes`. A reply over `max_reply_bytes` is not kept at all (taps can be large)."""

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float, max_reply_bytes: int):
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self.max_reply_bytes = max_reply_bytes
        # key -> (expiry, frames). Every entry lives `ttl_s`, so insertion order is expiry order.
        self._items: collections.OrderedDict[Hashable, tuple[float, list[Any]]] = collections.OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def get(self, key: Hashable) -> list[Any] | None:
        item = self._items.get(key)
        return None if item is None else item[1]

    def put(self, key: Hashable, frames: list[Any], now: float) -> bool:
        """Keep `frames` as the reply to `key`; False when it is too large to keep."""
        size = frames_bytes(frames)
        if size > self.max_reply_bytes:
            return False
        self._drop(key)
        self._items[key] = (now + self.ttl_s, frames)
        self.bytes += size
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            self._pop_oldest()
        return True

    def expire(self, now: float) -> int:
        """Drop the entries whose time is up; how many went."""
        n = 0
        while self._items and next(iter(self._items.values()))[0] < now:
            self._pop_oldest()
            n += 1
        return n

    def _drop(self, key: Hashable) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= frames_bytes(old[1])

    def _pop_oldest(self) -> None:
        _, (_, frames) = self._items.popitem(last=False)
        self.bytes -= frames_bytes(frames)
