"""Where the compute thread takes its work from: requests, landed groups and the stop sentinel.

The compute loop (worker/compute.py) asks one thing of its inbox: `get(timeout)`, the next `Queued` request, a
`Landed` group, None (stop) or `NOTHING` once `timeout` passed. Two inboxes give it:

- `QueueInbox`: a queue that others fill (tests/compute_driver.py, and any thread that hands requests in), and a
  landing-watch thread (worker/landing.py) that blocks on each launched group's event and puts a `Landed` on it.
- `SocketInbox`, the worker's: the compute thread is the worker's *data thread*. It owns its own DEALER to the
  broker (the data socket, identity `<id>/data`, announced in READY), reads requests from it, sends the replies on
  it, and, while a group is launched, polls that socket and the group's CUDA event in turn instead of sleeping.
  No hand-off to another thread and no landing thread on the way of a request: on the H200 each sleeping hop woke
  0.1-0.2 ms late and two threads trading the GIL cost more (docs/architecture.md, "The data path"). What the I/O
  thread still receives on the control socket (requests the broker routed there before the data socket was
  connected; the stop sentinel) it hands over with `put`, which also wakes the data thread.

Poll, then sleep: with a group launched the data thread never sleeps (a forward is milliseconds; it costs one core
only while a request is in the worker); after a reply it keeps polling for `poll_us` (a closed-loop caller's next
request arrives a round trip later), then blocks in `zmq.poll` until a message or `timeout`.

Lanes (protocol/lane.py, `lanes=True`): a client on this host may also ask on the direct socket to send its requests
through shared memory. The data thread reads its lanes and its sockets in turn while it polls, tells them whether it is
polling (a client sends on a lane only then), and answers a lane's request on the lane (waking the client if it
sleeps on the lane, ringing it on the direct socket if it sleeps on its sockets). A data thread falling asleep with
lanes open looks at them once more `NAP_MS` (protocol/lane.py) later (a client that saw it awake an instant before
is not left waiting; one that sees it asleep after writing rings it), then sleeps until a message comes.

Which request the data thread reads next, from its sockets and lanes in turn, is worker/reading.py's (a mixin of
`SocketInbox`: one thread's state, and no indirection on its path).
"""
from __future__ import annotations

import logging
import queue
import socket
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from laya_pool.protocol import wire
from laya_pool.protocol.lane import NAP_MS, Lane, lane_rid

from .landing import Landed, LandingWatch
from .lanes import Lanes
from .reading import NOTHING, SocketReading

log = logging.getLogger("laya-pool.worker")




class QueueInbox:
    """A queue filled by other threads; launched groups land through a landing-watch thread."""

    def __init__(self, name: str = "landing"):
        self.queue: queue.Queue = queue.Queue()
        self.landing = LandingWatch(self.queue.put, name=name)

    def put(self, item: Any) -> None:
        self.queue.put(item)

    def get(self, timeout: float) -> Any:
        try:
            return self.queue.get(timeout=timeout) if timeout > 0 else self.queue.get_nowait()
        except queue.Empty:
            return NOTHING

    def watch(self, flight: Any) -> None:
        self.landing.watch(flight)

    def quiesce(self) -> None:
        self.landing.quiesce()

    def close(self) -> None:
        self.landing.close()


class SocketInbox(SocketReading):
    """The data thread's own socket to the broker, polled with the launched group's event (see the module doc); which
    request it reads next is worker/reading.py's.

    Built by the I/O thread (so `put` works before the data thread runs); `open` (in the data thread) connects the
    data socket; `send` and `get` are the data thread's alone. `intake(msg, now)` turns a request message into a
    `Queued`, or answers it itself and returns None (worker/compute.py `Compute.intake`); `oldest()` is the oldest
    launched group, or None."""

    def __init__(self, ctx: zmq.Context, endpoint: str, identity: str, *, keys: str | None = None,
                 max_message_bytes: int, poll_us: int = 0, heartbeat_ms: int = 1000, direct: str | None = None,
                 lanes: bool = False, direct_max_bytes: int = wire.MAX_BODY_BYTES):
        """`direct_max_bytes`: the largest request buffer the direct socket takes (the worker's capacity's: a larger
        frame drops its client's connection, and each client's queue there is sized in bytes by it)."""
        self.ctx, self.endpoint, self.identity, self.keys = ctx, endpoint, identity, keys
        self.max_message_bytes, self.poll_s, self.heartbeat_ms = max_message_bytes, poll_us / 1e6, heartbeat_ms
        # Clients' own requests (docs/architecture.md, "The data path", decision 1): a ROUTER bound here, by the I/O
        # thread, so that READY can name the port it got; read and answered by the data thread alone.
        self.direct: zmq.Socket | None = None
        self.direct_endpoint: str | None = None
        self.direct_key: str | None = None    # with keys: its CURVE public key (z85), for the broker's table
        self.direct_auth: Any = None          # ... and the ZAP handler that admits the pool's client keys
        if direct is not None:
            # Before the bind: a CURVE socket with no ZAP handler in its context would admit every key.
            if keys:
                self.direct_auth = wire.start_authenticator(ctx, {"clients": Path(keys) / "authorized"})
            try:
                # A client's request is what comes here: at most what this worker's capacity holds.
                self.direct, self.direct_key = _bind_direct(ctx, direct, direct_max_bytes, keys)
            except BaseException:
                self._stop_auth()     # its thread and sockets would keep the context from terminating
                raise
            self.direct_endpoint = announced(self.direct.getsockopt_string(zmq.LAST_ENDPOINT))
        self.direct_taken = 0         # requests clients sent here directly
        self.requests_messages = 0    # ... of them in REQUESTS messages: how many such messages
        self.lanes = Lanes() if lanes and direct is not None else None
        self.unroutable = 0           # direct replies whose client had gone
        self.handed: queue.SimpleQueue = queue.SimpleQueue()     # from the I/O thread
        # put() wakes a data thread blocked in zmq.poll: a PAIR whose sending end only the I/O thread uses.
        addr = f"inproc://wake-{id(self)}"
        self.wake_in = ctx.socket(zmq.PAIR)
        self.wake_in.bind(addr)
        self.wake_out = ctx.socket(zmq.PAIR)
        self.wake_out.connect(addr)
        self.sock: zmq.Socket | None = None
        self.intake: Callable[..., Any] = lambda msg, now, to=None: None
        self.oldest: Callable[[], Any] = lambda: None
        self.farewell: list[Any] | None = None   # the leaving DISCONNECT, sent after the last reply (see `close`)
        self.malformed = 0            # messages on the data socket that did not decode
        self.via_control = 0          # request messages the I/O thread handed over (the rest came to the data socket)
        self.awake_until = 0.0
        self.lanes_first = False      # `_receive`: the lanes are read before the sockets on every other call
        # The requests of a client's REQUESTS message not taken yet (each `(msg, received, to)`): read first.
        self.pending: deque[tuple[wire.Message, float, Any]] = deque()
        self.hot: zmq.Socket | None = None    # `_receive_sockets`: the socket the last read found a request on
        self.hot_reads = 0                    # ... and how many reads in a row it has had without a poll

    # -- the I/O thread ------------------------------------------------------------------------------------------
    def put(self, item: Any) -> None:
        """Hand over a request message as `(msg, received)`, or None (stop)."""
        self.handed.put(item)
        try:
            self.wake_out.send(b"", zmq.NOBLOCK)
        except zmq.Again:            # the wake-up queue is full: the data thread is awake enough
            pass

    def qsize(self) -> int:
        return self.handed.qsize()

    # -- the data thread -----------------------------------------------------------------------------------------
    def open(self) -> None:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, self.identity.encode())
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        # No messages of its own to tell a dead connection from a quiet one (the control socket has the
        # heartbeats): ZeroMQ's own, so a half-open connection is dropped and made again.
        s.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ms)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self.heartbeat_ms)
        if self.keys:
            wire.configure_curve_client(s, self.keys, role="worker")
        s.connect(self.endpoint)
        self.sock = s
        self.poller = zmq.Poller()
        self.poller.register(s, zmq.POLLIN)
        self.poller.register(self.wake_in, zmq.POLLIN)
        if self.direct is not None:
            self.poller.register(self.direct, zmq.POLLIN)

    def send(self, frames: list[Any], to: bytes | Lane | None = None) -> None:
        """A reply: on the data socket (the broker takes a worker's replies from either of its sockets), or, for a
        request a client sent here itself, back to that client (`to`: its identity on the direct socket, or the lane
        the request came on)."""
        if isinstance(to, Lane):
            self._answer_lane(to, frames)
            return
        # A reply without taps is a header and two small buffers: pyzmq copies frames under 64 KiB even when asked
        # not to, and asked to copy it takes 0.45 us a reply less (timed on the worker's stages); taps (MBs) go
        # uncopied.
        copy = len(frames) <= 3
        try:
            if to is None:
                wire.send_frames(self.sock, frames, copy=copy)
            else:
                wire.send_frames(self.direct, [to, *frames], copy=copy)
        except zmq.Again:
            log.warning("worker %s: the %s's queue is full; dropped a reply", self.identity,
                        "broker" if to is None else "client")
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.unroutable += 1      # the client left (ROUTER_MANDATORY says so): its retry went elsewhere
            if self.lanes is not None:
                self.lanes.forget(to)
        self.awake_until = time.monotonic() + self.poll_s

    def _answer_lane(self, lane: Lane, frames: list[Any]) -> None:
        """On the lane when the reply fits (which wakes a client asleep on it), else on the direct socket (and the lane
        says so)."""
        if not lane.mapped():         # closed here to make room for another (`Lanes`): the socket it is
            self.send(frames, lane.identity)
            return
        if lane.closed():
            return                    # the client left; its retry went elsewhere
        self.lanes.answered(lane)
        if lane.reply(frames):
            if lane.wants_ring():         # it sleeps on its sockets (several calls out): ring it there
                self.send(wire.encode(wire.Cmd.LANE, {"rid": lane_rid(lane.name), "status": wire.STATUS_OK,
                                                      "ring": True}), lane.identity)
            else:
                self.awake_until = time.monotonic() + self.poll_s
            return
        self.send(frames, lane.identity)
        if lane.mapped():             # (the send may have found its client gone and closed the lane)
            lane.reply(None)

    def watch(self, flight: Any) -> None:
        pass                          # `get` polls the oldest launched group itself

    def quiesce(self) -> None:
        pass                          # no other thread of this worker makes CUDA calls

    def get(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            item = self._ready()
            if item is not NOTHING:
                if self.lanes is not None:
                    self.lanes.set_awake(True)    # (found after a nap: polling again)
                return item
            now = time.monotonic()
            if now >= deadline:
                return NOTHING
            if self.oldest() is not None or now < self.awake_until:
                continue              # poll: a group is computing, or a reply just went out
            wait_ms = max(1, int((deadline - now) * 1e3))
            if self.lanes is not None and self.lanes.awake:
                self.lanes.set_awake(False)
                item = self._ready()          # a request written while the lanes still said awake
                if item is not NOTHING:
                    self.lanes.set_awake(True)
                    return item
                wait_ms = min(wait_ms, NAP_MS)     # and once more after a nap (see the module docstring)
            woken = self.poller.poll(wait_ms)
            if woken and self.lanes is not None:
                self.lanes.set_awake(True)
            self._drain_wakes()

    def _ready(self) -> Any:
        """What is there now, without waiting: handed over, then the data socket, then a landed group."""
        if not self.handed.empty():       # this thread is its only reader: not empty now, not empty at the get
            return self._taken(self.handed.get_nowait())
        item = self._receive()
        if item is not NOTHING:
            return item
        flight = self.oldest()
        if flight is not None and flight.job.done():
            return Landed(flight)
        return NOTHING

    def _taken(self, item: Any) -> Any:
        if isinstance(item, tuple):              # (msg, received): a request the I/O thread read
            self.via_control += 1
            q = self.intake(*item)
            return NOTHING if q is None else q
        return item

    def _drain_wakes(self) -> None:
        while True:
            try:
                self.wake_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self) -> None:
        """The data thread is done (also when it failed). What the broker sent and nobody read is answered here
        ("stopping", by `intake`: the I/O thread set `Compute.stopping` before it asked the thread to stop), then the
        leaving DISCONNECT goes out on this same connection, after every reply: the broker must not see the worker
        leave before its last answers, nor count a request still unread here as lost with it."""
        if self.sock is not None:
            try:
                # A request `intake` did not answer (the thread died, not stopping) is dropped: the broker re-sends
                # what a worker held when it leaves.
                while self._receive() is not NOTHING:
                    pass
                if self.farewell is not None:
                    wire.send_frames(self.sock, self.farewell, copy=False)
            except zmq.ZMQError as e:
                log.warning("worker %s: closing the data socket: %s", self.identity, e)
            self.sock.close(linger=2000)
            self.sock = None
        if self.lanes is not None:
            self.lanes.close()
        if self.direct is not None:
            self.direct.close(linger=500)
            self.direct = None
        self._stop_auth()
        if not self.wake_in.closed:
            self.wake_in.close(0)

    def _stop_auth(self) -> None:
        if self.direct_auth is not None:
            wire.stop_authenticator(self.direct_auth)
            self.direct_auth = None


DIRECT_HWM = 64             # replies queued for a client at the direct socket: 4 x this (each within the capacity)
DIRECT_BUFFER_BYTES = 8 << 20   # what one client's requests queued at the direct socket may hold


def direct_limits(largest: int) -> tuple[int, int]:
    """(ZMQ_MAXMSGSIZE, ZMQ_RCVHWM) of a direct socket whose largest request buffer is `largest` bytes: a frame is at
    most a header or such a buffer, and a client's queue holds at most DIRECT_BUFFER_BYTES of such messages (2 at
    least). With the default capacity (16,384 tokens, 64 rows, 2,048 markers: 74,496 bytes) that is 59 messages, 8 MiB;
    it was 64 of 64 MiB each (a worker grew 404 -> 1,186 MB from four peers' 60 MB frames, issue #54)."""
    return max(wire.MAX_HEADER_BYTES, largest), max(2, DIRECT_BUFFER_BYTES // (wire.MAX_HEADER_BYTES + largest))


def _bind_direct(ctx: zmq.Context, endpoint: str, largest: int,
                 keys: str | None = None) -> tuple[zmq.Socket, str | None]:
    """The ROUTER clients send their requests to, and its CURVE public key (with `keys`: a CURVE server with the
    worker's key pair, admitting the keys the broker's frontend admits; so it may listen beyond loopback). Bounded
    per peer in bytes (`direct_limits`): a larger frame drops the connection, and beyond the queue a client's
    non-blocking send is refused (it goes through the broker); a reply to a client that has gone raises instead of
    queueing (ROUTER_MANDATORY)."""
    max_frame, rcvhwm = direct_limits(largest)
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 500)
    s.setsockopt(zmq.MAXMSGSIZE, max_frame)
    s.setsockopt(zmq.RCVHWM, rcvhwm)
    s.setsockopt(zmq.SNDHWM, 4 * DIRECT_HWM)
    s.setsockopt(zmq.ROUTER_MANDATORY, 1)
    key = wire.configure_curve_server(s, keys, "worker", "clients").decode() if keys else None
    s.bind(endpoint)
    return s, key


def announced(endpoint: str) -> str:
    """The endpoint clients connect to: a wildcard bind (`tcp://*:*` reads back as 0.0.0.0) is named by this host's
    name, which clients on other hosts resolve (bind one interface's address to name it exactly)."""
    if wire.is_unspecified(endpoint):
        return f"tcp://{socket.gethostname()}:{endpoint.rpartition(':')[2]}"
    return endpoint
