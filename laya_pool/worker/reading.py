"""Which request the worker's data thread reads next (worker/inbox.py `SocketInbox`): its sockets and its lanes in turn.

The data socket (the broker's requests) and the direct socket (clients' own, docs/architecture.md, "The data path")
are asked with one poll, then, while a group computes, the socket that just gave a request is read again without a
poll (hot reads); the lanes (protocol/lane.py) and the sockets take turns, so neither waits more than one read. On
the direct socket a client may also send several requests in one REQUESTS message (taken one by one, as if each had
come alone) and ask for a lane (LANE).

A mixin of `SocketInbox`, which holds the sockets (`sock`, `direct`, `poller`), the lanes (`lanes`), what the compute
thread gives it (`intake`, `oldest`), the replies (`send`, `_answer_lane`) and the counters.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from laya_pool.protocol import wire
from laya_pool.protocol.contract import Reason
from laya_pool.protocol.lane import lane_rid

from .lanes import Full

log = logging.getLogger("laya-pool.worker")

NOTHING = object()          # `get` found nothing before its timeout
HOT_READS = 16      # `_receive_sockets`: reads of the socket that last gave a request before the next poll


class SocketReading:
    """The reading half of `SocketInbox`."""

    def _receive(self) -> Any:
        """The next request read from the sockets or the lanes, or NOTHING; each call starts where the last did not.

        Sockets always first starved the lanes: while the sockets kept a request waiting (an asyncio client's other
        calls, the rest of a busy pool's clients) a request on a lane was read only when its attempt had timed out,
        1.4 s later, and its retry went through the broker. In turn neither side waits more than one read.

        A REQUESTS message's requests (`pending`, from the direct socket) count as hot reads of that socket: HOT_READS
        of them, then the data socket and the lanes get a read, so one client's message of 64 does not keep the
        broker's requests or a lane's waiting behind all of them (taken whole, 1,023 could go before the broker's one).
        Other clients' messages on the direct socket wait for the message before theirs, as ZeroMQ queues them."""
        if self.pending:
            if self.hot_reads < HOT_READS:
                self.hot_reads += 1
                q = self._take_pending()
                if q is not NOTHING:
                    return q
            else:
                self.hot_reads = 0
                item = self._receive_from(self.sock, direct=False)
                if item is NOTHING and self.lanes is not None:
                    item = self._receive_lanes()
                if item is not NOTHING:
                    return item
                q = self._take_pending()
                if q is not NOTHING:
                    return q
        return self._receive_fresh()

    def _take_pending(self) -> Any:
        while self.pending:
            q = self.intake(*self.pending.popleft())
            if q is not None:
                return q
        return NOTHING

    def _receive_fresh(self) -> Any:
        """`_receive` from the sockets and the lanes, in turn."""
        self.lanes_first = not self.lanes_first and self.lanes is not None
        if self.lanes_first:
            item = self._receive_lanes()
            return item if item is not NOTHING else self._receive_sockets()
        item = self._receive_sockets()
        if item is not NOTHING or self.lanes is None:
            return item
        return self._receive_lanes()

    def _receive_sockets(self) -> Any:
        """The next request read from the data socket, then from the direct one, or NOTHING. One poll asks both
        sockets first: a receive that finds nothing raises, 3.6 us a socket on the development CPU, where the poll
        takes 1.4 us for all (and a polling data thread asks thousands of times a forward).

        While a group computes (so the host's time is not what the device waits for), the socket that just gave a
        request most likely holds the next one too: it is read again without a poll, up to HOT_READS times in a row
        (then a poll, which reads the data socket first), and the first read that finds nothing (2.7 us, where a poll
        takes 0.7) goes back to polling. So with the direct socket hot, the broker's requests wait behind at most
        HOT_READS of the clients'; the other way round the poll's order (the data socket first) holds. A lone request's
        launch never waits for that read: nothing computes when it arrives (its group pays it once, while the device
        runs)."""
        hot = self.hot
        if hot is not None and self.hot_reads < HOT_READS and self.oldest() is not None:
            self.hot_reads += 1
            item = self._receive_from(hot, direct=hot is self.direct)
            if item is not NOTHING:
                return item
            self.hot = None
        item = self._poll_sockets()
        if item is not NOTHING:
            self.hot_reads = 0
        else:
            self.hot = None         # nothing anywhere: the next request is found by a poll, whichever socket it is on
        return item

    def _poll_sockets(self) -> Any:
        ready = self.poller.poll(0)
        if ready:
            socks = dict(ready)
            if socks.get(self.sock):
                item = self._receive_from(self.sock, direct=False)
                if item is not NOTHING:
                    self.hot = self.sock
                    return item
            if self.direct is not None and socks.get(self.direct):
                item = self._receive_from(self.direct, direct=True)
                if item is not NOTHING:
                    self.hot = self.direct
                    return item
        return NOTHING

    def _receive_lanes(self) -> Any:
        while True:
            got = self.lanes.take()
            if got is None:
                return NOTHING
            now = time.monotonic()
            lane, frames = got
            try:
                if isinstance(frames, wire.ProtocolError):
                    raise frames
                msg = wire.decode(frames)
                if msg.cmd != wire.Cmd.REQUEST:
                    raise wire.ProtocolError("command", f"a lane takes requests only, not {msg.cmd.name}")
            except wire.ProtocolError as e:
                self.malformed += 1
                log.warning("worker %s: malformed message on lane %s (%s)", self.identity, lane.name, e)
                rid = wire.rid_of(frames) if isinstance(frames, list) and frames else None
                refusal = wire.encode_error(rid, wire.STATUS_FINAL, str(e), field=e.field)
                self._answer_lane(lane, wire.in_kind(frames, refusal) if isinstance(frames, list) else refusal)
                continue
            q = self.intake(msg, now, lane)
            if q is not None:
                return q

    def _receive_from(self, sock: zmq.Socket, direct: bool) -> Any:
        while True:
            try:
                frames = wire.recv_frames(sock)
            except zmq.Again:
                return NOTHING
            now = time.monotonic()
            to = frames.pop(0) if direct else None
            try:
                msg = wire.decode(frames)
            except wire.ProtocolError as e:
                self.malformed += 1
                log.warning("worker %s: malformed message on the %s socket (%s)", self.identity,
                            "direct" if direct else "data", e)
                if direct:      # a client waits for it: say what is wrong (the broker's messages are well-formed)
                    self.send(wire.in_kind(frames, wire.encode_error(wire.rid_of(frames) if frames else None,
                                                                     wire.STATUS_FINAL, str(e), field=e.field)), to)
                continue
            if direct and msg.cmd == wire.Cmd.LANE:
                self._open_lane(msg, to)
                continue
            if direct and msg.cmd == wire.Cmd.REQUESTS:
                q = self._take_requests(msg, now, to)
                if q is not None:
                    return q
                continue
            if msg.cmd != wire.Cmd.REQUEST:
                # Control messages come on the control socket; a restarted broker's word reaches that one too. A
                # client waits for an answer to anything it sends here: only requests are taken.
                log.debug("worker %s: %s on the %s socket, ignored", self.identity, msg.cmd.name,
                          "direct" if direct else "data")
                if direct:
                    self.send(wire.encode_error(wire.rid_of(frames), wire.STATUS_FINAL, "a worker's direct socket "
                                                f"takes requests only, not {msg.cmd.name}", field="command"), to)
                continue
            if direct:
                self.direct_taken += 1
            q = self.intake(msg, now, to)
            if q is not None:
                return q

    def _take_requests(self, msg: wire.Message, now: float, to: bytes) -> Any:
        """A client's REQUESTS: its requests, taken one by one as if each had come alone (the first now, the rest
        from `pending`); one that does not split is refused, each of its requests told why."""
        try:
            requests = wire.split_requests(msg)
        except wire.ProtocolError as e:
            self.malformed += 1
            log.warning("worker %s: malformed REQUESTS on the direct socket (%s)", self.identity, e)
            for rid in wire.rids_of_requests(msg) or [None]:
                self.send(wire.encode_error(rid, wire.STATUS_FINAL, str(e), field=e.field), to)
            return None
        self.direct_taken += len(requests)
        self.requests_messages += 1
        self.pending.extend((m, now, to) for m in requests)
        q = self._take_pending()
        return None if q is NOTHING else q

    def _open_lane(self, msg: wire.Message, to: bytes) -> None:
        """A client's LANE: open its lane and say so, or say why not (it goes on over the socket). A ring (a request
        written on a lane as this thread fell asleep) asks for nothing: it woke the thread, which reads its lanes."""
        if msg.header.get("ring") is True:
            return
        name = msg.header.get("lane")
        rid = lane_rid(name if isinstance(name, str) else "")
        try:
            if self.lanes is None:
                raise wire.ProtocolError("lane", "this worker takes no lanes (--lanes)")
            self.lanes.attach(name, msg.header.get("secret"), to)
        except wire.ProtocolError as e:
            self.send(wire.encode_error(rid, wire.STATUS_FINAL, str(e), field=e.field), to)
            return
        except Full as e:             # no room now: the client asks again with its next table
            self.send(wire.encode_error(rid, wire.STATUS_RETRYABLE, str(e), field="lane", reason=Reason.BUSY), to)
            return
        except OSError as e:          # mapping it failed: no lane, and the data thread goes on
            self.send(wire.encode_error(rid, wire.STATUS_FINAL, f"cannot map the lane: {e}", field="lane"), to)
            return
        self.send(wire.encode(wire.Cmd.LANE, {"rid": rid, "status": wire.STATUS_OK}), to)
