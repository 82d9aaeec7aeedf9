"""Where the blocking `Client`'s replies come from, and how it waits for them.

Replies come on the broker's socket, on the workers' direct sockets (client/direct.py) and on lanes (shared memory,
protocol/lane.py); the monitors say when a connection dropped. `poll` waits for any of them: polling without
sleeping for the client's `spin_ms` first, and with requests on lanes polling the lanes, then asleep on the lane the
one call out waits on (a futex its worker wakes) or on the sockets, its workers asked to ring there.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import zmq

from laya_pool.protocol import wire
from laya_pool.protocol.lane import NAP_MS

from .direct import Routes
from .state import alone

LANE = "lane"              # `poll`: a lane has an answer (a key beside the ready sockets)
# A request on a lane is waited for by polling its answer for up to this long, then asleep on it until the worker wakes
# it (protocol/lane.py); 5 ms covers a forward up to 4x256 on the H200. By default only when no
# other Python thread could want the GIL (client/state.py `alone`): a polling thread holds it, and another thread
# that wants it waits up to Python's switch interval (5 ms) for it.
LANE_SPIN_MS = 5.0


class Receiver:
    """The blocking client's reply sockets (`sock`, its monitor `mon`, the routes' sockets, all in `poller`) and
    lanes. `spin`: seconds to poll without sleeping first; `spin_auto`: poll a lane LANE_SPIN_MS when alone."""

    def __init__(self, sock: zmq.Socket, mon: zmq.Socket, poller: zmq.Poller, routes: Routes | None, spin: float,
                 spin_auto: bool):
        self.sock, self.mon, self.poller, self.routes = sock, mon, poller, routes
        self.spin, self.spin_auto = spin, spin_auto

    def replies(self, ready: dict[Any, int]) -> Iterator[wire.Message]:
        """Every message waiting on the ready reply sockets (the broker's, then the workers' direct ones), and the
        lanes' answers."""
        routes = self.routes
        if ready.get(LANE):
            for frames in routes.answers():
                msg = wire.decode(frames)
                routes.replied(msg.header)
                yield msg
        socks = [self.sock] if ready.get(self.sock) else []
        if routes is not None:
            socks += [s for s in ready if s is not self.sock and s is not self.mon and self._is_route(s)]
        for s in socks:
            while True:
                try:
                    frames = wire.recv_frames(s)
                except zmq.Again:
                    break
                msg = wire.decode(frames)            # a reply that breaks the protocol is an error, not noise
                if routes is not None:
                    if s is not self.sock:
                        routes.heard_from(routes.owner(s))
                    routes.replied(msg.header)
                yield msg

    def dropped(self, ready: dict[Any, int]) -> list[int]:
        """Request ids whose worker's direct connection dropped (from the routes' monitors that are ready) or whose
        worker closed the lane they were on."""
        if self.routes is None:
            return []
        lost = self.routes.take_lost()               # on lanes their workers closed
        for s in ready:
            r = self.routes.owner(s)
            if r is not None and s is r.mon:
                lost.extend(self.routes.events(s))
        return lost

    def _is_route(self, s: Any) -> bool:
        r = self.routes.owner(s) if self.routes is not None else None
        return r is not None and s is r.sock

    def poll(self, wait_ms: int, sole: bool = True) -> dict[Any, int]:
        """The sockets ready within `wait_ms`, polling without sleeping for the first `spin_ms` of it. `sole`: one
        call is out (a lane's answer is all it waits for)."""
        if self.routes is not None and self.routes.waiting:
            return self._poll_lanes(wait_ms, sole)
        if self.spin:
            end = time.perf_counter() + min(self.spin, wait_ms / 1000.0)
            while True:
                ready = self.poller.poll(0)
                if ready:
                    return dict(ready)
                if time.perf_counter() >= end:
                    break
            wait_ms = max(0, wait_ms - int(self.spin * 1000))
        return dict(self.poller.poll(wait_ms))

    def _poll_lanes(self, wait_ms: int, sole: bool) -> dict[Any, int]:
        """`poll` with requests on lanes: their answers (`LANE`) or the sockets ready within `wait_ms`, polling
        first (`_spin_lanes`), then asleep NAP_MS at a time, looking at the sockets in between: on the lane (a futex
        the worker wakes: protocol/lane.py) when the one call out (`sole`) waits there, else on the sockets, asking
        the lanes' workers to ring there."""
        deadline = time.perf_counter() + wait_ms / 1000.0
        spin = self.spin or (LANE_SPIN_MS / 1000.0 if self.spin_auto and alone() else 0.0)
        if spin:
            ready = self._spin_lanes(min(deadline, time.perf_counter() + spin))
            if ready is not None:
                return ready
        while True:
            if self.routes.lane_ready():
                return {LANE: 1}
            ready = self.poller.poll(0)
            left = deadline - time.perf_counter()
            if ready or left <= 0:
                return self._with_lanes(ready)
            waiting = self.routes.waiting
            if sole and len(waiting) == 1 and waiting[0].lane.sleep(min(NAP_MS / 1000.0, left)):
                continue
            ready = self._sleep_on_sockets(min(NAP_MS, int(left * 1000) + 1))
            if ready:
                return self._with_lanes(ready)

    def _sleep_on_sockets(self, ms: int) -> list:
        """Sleep on the sockets up to `ms`, the lanes' workers asked to ring us there after answering."""
        waiting = list(self.routes.waiting)
        for r in waiting:
            r.lane.ring_me(True)
        try:
            if self.routes.lane_ready():     # answered before it saw the ask
                return []
            return self.poller.poll(ms)
        finally:
            for r in waiting:
                if r.lane is not None:
                    r.lane.ring_me(False)

    def _spin_lanes(self, end: float) -> dict[Any, int] | None:
        """Poll the lanes without sleeping until `end`, the sockets every 32 looks; None: nothing came."""
        routes = self.routes
        looks = 0
        while True:
            if routes.lane_ready():
                return {LANE: 1}
            looks += 1
            if looks % 32 == 0:
                ready = self.poller.poll(0)
                if ready:
                    return self._with_lanes(ready)
                if time.perf_counter() >= end:
                    return None

    def _with_lanes(self, ready: list) -> dict[Any, int]:
        out = dict(ready)
        if self.routes.lane_ready():
            out[LANE] = 1
        return out
