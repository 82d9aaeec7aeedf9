"""The asyncio client's requests straight to the workers: client/direct.py's routes, read from the event loop.

Each route's socket is read by a callback on its descriptor (client/reader.py), its monitor by a task through an asyncio
view of it (`_watch`): a reply goes to its call (the client's `_received` and `_deliver`), a dropped connection re-sends
at once what was on it. A first attempt (`send`) goes on the route's lane when other calls of the client are out and the
lane is free, else on the route's socket, or, with `together`, in one REQUESTS message with the other requests of the
same turn of the event loop to that worker (`_send_together`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import zmq

from laya_pool.protocol import wire
from laya_pool.protocol.wire import Cmd

from .direct import RETRY_S, RING_IT, ROUTES_TIMEOUT_S, Routes
from .errors import PoolError
from .plans import header_only
from .reader import Reader
from .watch import RECONNECTED

log = logging.getLogger("laya-pool.client")

# An asyncio client's direct requests of one event-loop turn travel together (`_send_together`): at most this many in
# one REQUESTS message, each at most TOGETHER_BYTES (a larger one goes alone), so a message stays far below a direct
# socket's size limit.
TOGETHER = 64
TOGETHER_BYTES = 256 << 10


class AsyncRoutes:
    """The direct routes of one `AsyncClient` (`client`), on `ctx` (an asyncio context: the routes' sockets are plain
    ones on its shadow, a non-blocking send refused at once, as the blocking client's)."""

    def __init__(self, client: Any, ctx: Any, lanes: bool):
        self.client = client
        self.routes = Routes(zmq.Context.shadow(ctx.underlying), None, wire.MAX_BODY_BYTES + wire.MAX_HEADER_BYTES,
                             watch=self._watch, unwatch=self._unwatch, keys=client.keys, key_role=client.key_role,
                             lanes=lanes)
        # worker -> its socket's reader, its monitor's task and that task's asyncio view of the monitor
        self.readers: dict[str, tuple[Reader, asyncio.Task, Any]] = {}
        # Direct requests waiting for this turn's REQUESTS message, by worker (`_send_together`).
        self.outbox: dict[str, list[tuple[int, list[Any], asyncio.Future]]] = {}

    async def ask(self) -> None:
        """Ask the broker which workers take requests themselves, when the table is due (client/direct.py)."""
        routes = self.routes
        if not routes.due(time.monotonic()):
            return
        routes.next_ask = time.monotonic() + RETRY_S      # one question at a time, whatever the tasks
        try:
            ask = header_only(Cmd.HEARTBEAT, routes=True)
            msg, _ = await self.client.call(Cmd.HEARTBEAT, ask, ROUTES_TIMEOUT_S, 0)
            table = msg.header.get("routes", [])
        except PoolError:
            table = None
        if self.client._sock is not None:
            routes.asked(table, time.monotonic())
            self.resend_lost()           # what was out on a route the table dropped
            await self.send_asks()

    async def send_asks(self) -> None:
        """Lane requests the routes made (client/direct.py `take_asks`), on their routes' sockets."""
        for r, ask in self.routes.take_asks():
            if not self._send_on(r, ask):
                self.routes.unask(r)          # (asked for again with a later table)

    def _send_on(self, r: Any, frames: list[Any]) -> bool:
        """`frames` on `r`'s socket if its queue takes them now; its reader looks again after (a send may take the
        edge of the descriptor it waits on: client/reader.py)."""
        readers = self.readers.get(r.worker)
        if readers is None:
            return False
        try:
            r.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:           # its queue is full
            return False
        finally:
            readers[0].sent()
        return True

    async def send(self, rid: int, framed: list[Any]) -> bool:
        """A first attempt on a route's lane or socket (False: none took it; it goes through the broker)."""
        r = self.routes.choose()
        if r is None or r.worker not in self.readers:
            return False
        # A lane only with other calls of this client out (`_waiters` holds this one too). The event loop cannot wait
        # on a lane, so a lane's answer comes as a ring on this very socket and then a read of the lane: for a lone
        # call that costs more than the answer on the socket (1x48 at 1 in flight, H200 host: 2.01 against 1.88 ms
        # p50), while with calls out together lanes win (at 64: 7,595 against 6,403 req/s;
        # docs/decisions/0014-clients-straight-to-the-workers.md).
        if len(self.client._waiters) > 1 and r.lane_open and r.lane_rid is None:
            took = self.routes.on_lane(r, rid, framed)
            if took is RING_IT:
                self._send_on(r, self.routes.ring(r))    # (its queue full: it is awake enough)
            if took:
                return True
        # This client reads BUNDLEs (`_deliver`): the worker may answer this request with the others of ours it runs in
        # the same forward, in one message.
        framed = wire.with_bundles(framed) if self.client.bundles else framed
        if (self.client.together and r.together and len(self.client._waiters) > 1 and len(framed) == 2
                and len(framed[1]) <= TOGETHER_BYTES):
            return await self._send_together(r, rid, framed)
        if not self._send_on(r, framed):
            return False
        self.routes.took(r, rid)
        return True

    async def _send_together(self, r: Any, rid: int, framed: list[Any]) -> bool:
        """With other calls out, this turn's direct requests to one worker go in one REQUESTS message: a call that
        resumes with a reply sends its next request, and the calls whose replies came in one bundle resume in one turn
        of the event loop (`_flush`, started by the first of them, runs after the rest have queued theirs). The
        request is counted as out now, so the next call's choice of worker sees it."""
        fut = asyncio.get_running_loop().create_future()
        queued = self.outbox.get(r.worker)
        if queued is None:
            queued = self.outbox[r.worker] = []
            asyncio.ensure_future(self._flush(r))
        queued.append((rid, framed, fut))
        self.routes.took(r, rid)
        return await fut

    async def _flush(self, r: Any) -> None:
        """Send what `_send_together` queued for `r`'s worker: one REQUESTS message per up to TOGETHER requests
        (alone when there is one); each call learns whether its request left (if not, it goes through the broker)."""
        queued = self.outbox.pop(r.worker, [])
        for at, end in _parts([len(framed[1]) for _, framed, _ in queued], self._together_bytes()):
            # Only what is still this route's: a route closed (a new table, its connection dropped) since took those
            # requests as lost, and their calls re-send them once (`resend_lost`); sent here, they would go twice.
            part = [item for item in queued[at:end] if self.routes.by_rid.get(item[0]) is r]
            ok = False
            try:
                if part:           # (its queue full: these go through the broker)
                    frames = part[0][1] if len(part) == 1 else wire.requests_message([f for _, f, _ in part])
                    ok = self._send_on(r, frames)
            except Exception:       # noqa: BLE001 - a call must never wait on a send that will not happen
                log.exception("could not send %d requests to worker %s together", len(part), r.worker)
            finally:
                for rid, _, fut in queued[at:end]:
                    lost = self.routes.by_rid.get(rid) is not r
                    if not ok and not lost:
                        self.routes.unsent(rid)
                    if not fut.done():
                        fut.set_result(ok or lost)      # lost: its call waits for the re-send `resend_lost` asks

    def _together_bytes(self) -> int:
        """The most one REQUESTS message's buffer may hold: what one forward of the pool's workers holds, and 64 KiB
        at least (a worker's direct socket takes no larger frame: worker/inbox.py `direct_limits`), where the pool
        said its capacity (a describe call); 64 KiB where not."""
        cap = self.client.capacity
        if not all(k in cap for k in ("max_rows", "max_tokens", "max_markers")):
            return wire.MAX_HEADER_BYTES
        return max(wire.MAX_HEADER_BYTES, wire.request_bytes(cap["max_rows"], cap["max_tokens"], cap["max_markers"]))

    def _watch(self, r: Any) -> None:
        import zmq.asyncio

        source = f"worker {r.worker}"
        reader = Reader(r.sock, lambda frames: self.client._received(frames, source, r), source)
        mon = zmq.asyncio.Socket.shadow(r.mon.underlying)
        self.readers[r.worker] = (reader, asyncio.ensure_future(self._watch_monitor(r, reader, mon)), mon)

    def _unwatch(self, r: Any) -> None:
        """Stop reading `r` (its sockets are closed after, by `Routes`)."""
        if r.worker in self.readers:
            reader, task, mon = self.readers.pop(r.worker)
            reader.close()
            task.cancel()
            mon.close(linger=0)       # an asyncio view owns nothing of its own: this closes the route's monitor

    async def _watch_monitor(self, r: Any, reader: Reader, mon: Any) -> None:
        """A route's connection events: a dropped one re-sends at once what was on it (its replies read first)."""
        while True:
            await mon.poll(flags=zmq.POLLIN)
            reader.drain()         # replies that came before the drop count (client/direct.py)
            for rid in self.routes.events(r.mon):
                fut = self.client._waiters.get(rid)
                if fut is not None and not fut.done():
                    fut.set_result(RECONNECTED)
            await self.send_asks()       # a connection back asks for its lane again

    def lane_answers(self) -> None:
        """Hand the lanes' answers to their calls; a call whose lane its worker closed unanswered re-sends now."""
        for frames in self.routes.answers():
            try:
                self.client._deliver(wire.decode(frames))
            except wire.ProtocolError as e:      # as on a socket: it fails no call (each waits for its own reply)
                log.warning("dropped an undecodable answer from a lane (%s)", e)
        self.resend_lost()

    def resend_lost(self) -> None:
        """Calls whose attempt was on a lane its worker closed, or on a route that closed: they re-send now."""
        for rid in self.routes.take_lost():
            fut = self.client._waiters.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(RECONNECTED)


def _parts(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """`[at, end)` spans of requests of these buffer sizes, each at most TOGETHER of them and at most `limit` bytes
    together (a request larger alone still goes, alone)."""
    out, at, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > at and (i - at >= TOGETHER or total + n > limit):
            out.append((at, i))
            at, total = i, 0
        total += n
    if at < len(sizes):
        out.append((at, len(sizes)))
    return out
