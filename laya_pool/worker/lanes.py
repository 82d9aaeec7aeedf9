"""The lanes clients on this host opened to the worker's data thread (protocol/lane.py): which are open, which has a
request, and telling them all whether the thread is polling. The data thread's alone; no sockets here (the inbox
answers and rings on sockets), so it is tested with real lanes and no pool."""
from __future__ import annotations

import time
from collections import OrderedDict

from laya_pool.protocol.lane import CLOSED, REQ_SEQ, Lane, sweep
from laya_pool.protocol.wire import ProtocolError

MAX_LANES = 64          # mapped at once (128 KB each): the least recently used idle one goes when a new one comes,
IDLE_S = 1.0            # idle: nothing on it now and nothing asked or answered this long. With none idle the new one
                        # is refused for now (`Full`; the client asks again with its next table), so more busy clients
                        # than lanes do not take lanes from each other, and no lane goes with a request on it (its
                        # client would re-send it, or, an asyncio client not watching the lane, wait for it)


class Full(Exception):
    """No lane is idle: a new one must wait (its client goes on over its socket)."""


class Lanes:
    def __init__(self, limit: int = MAX_LANES):
        sweep()                   # what clients that died before any worker took their lanes left
        self.limit = limit
        self.open: OrderedDict[str, Lane] = OrderedDict()     # by name, least recently used first
        self.awake = False
        self.taken = 0            # requests read from lanes
        self.evicted = 0          # lanes closed to make room
        self.refused = 0          # lanes refused for want of room (`Full`)

    def attach(self, name: object, secret: object, identity: bytes) -> Lane:
        """Open a client's lane (a ProtocolError says why not); `identity`: the client on the direct socket, where
        what the lane cannot carry goes and where rings go."""
        if name in self.open:
            raise ProtocolError("lane", f"{name} is open already")
        now = time.monotonic()
        self._drop_closed()
        if len(self.open) >= self.limit:
            idle = next((x for x in self.open.values() if now - x.used >= IDLE_S and x.empty()), None)
            if idle is None:
                self.refused += 1
                raise Full(f"none of the {self.limit} lanes is idle ({IDLE_S:g} s without a request)")
            del self.open[idle.name]
            idle.leave()              # its client asks for a lane again with its next table
            self.evicted += 1
        lane = Lane.open(name, secret)
        lane.identity = identity
        lane.used = now
        lane.set_awake(self.awake)
        self.open[lane.name] = lane
        return lane

    def answered(self, lane: Lane) -> None:
        """`lane`'s request was answered: it was in use until now."""
        lane.used = time.monotonic()

    def _drop_closed(self) -> None:
        """Close the lanes whose clients closed them (a client that left must not keep a newcomer out)."""
        for name in [n for n, x in self.open.items() if x.closed()]:
            self.open.pop(name).close()

    def take(self) -> tuple[Lane, list[bytes] | ProtocolError] | None:
        """The first lane with a new request, and its frames (or why they are not a message); None: none has one.
        A lane whose client closed it is closed here. (The data thread asks thousands of times a forward: nothing is
        allocated on the way to None.)"""
        for lane in self.open.values():
            # `has_request() or closed()` inline: this loop runs over every lane on each turn of the data thread's
            # polling (64 lanes: 9.6 us a turn through the methods on the development CPU, 7.3 like this)
            w = lane.words
            if w[REQ_SEQ] != lane.seen or w[CLOSED] or not lane.mapped():
                break
        else:
            return None
        if lane.closed():
            del self.open[lane.name]
            lane.close()
            return self.take()
        self.taken += 1
        lane.used = time.monotonic()
        self.open.move_to_end(lane.name)
        try:
            return lane, lane.asked()
        except ProtocolError as e:
            return lane, e

    def set_awake(self, on: bool) -> None:
        """Whether the data thread polls the lanes now: a client sends on a lane only while it does."""
        if on != self.awake:
            self.awake = on
            for lane in self.open.values():
                lane.set_awake(on)

    def forget(self, identity: bytes) -> None:
        """The client `identity` is gone from the direct socket: close its lanes."""
        for name, lane in list(self.open.items()):
            if lane.identity == identity:
                self.open.pop(name)
                lane.leave()

    def __len__(self) -> int:
        return len(self.open)

    def close(self) -> None:
        for lane in self.open.values():
            lane.leave()
        self.open.clear()
