"""Requests straight to the workers: the client's side of docs/architecture.md, "The data path", decision 1.

A worker may take requests on a socket of its own (announced to the broker in its READY); the broker hands the
table of them out (`routes` in a ping's reply). In a pool without keys those sockets are on loopback, for clients
on the worker's host; in a pool with keys each is a CURVE server with the worker's key, which the table gives, so
a client with the pool's keys authenticates it and may use it from any host. The blocking `Client` sends a
request's FIRST attempt to the worker the pool's routing policy chooses (protocol/routing.py, as the broker does:
the fewest of this client's requests in flight there), and every later attempt through the broker, which stays the
path of last resort: a worker that refuses (stopping, busy, handed back), goes quiet past the attempt's share of the
deadline, or drops its connection (killed: the call re-sends at once, through the broker) costs one attempt, not the
call. A quiet worker is sent nothing more until the next table only if nothing came from it since that attempt
went out (else it is alive and the attempt waited in its queue). The broker's reply cache does not see a direct
attempt, so a request whose direct attempt ran but whose answer was lost runs again through the broker:
at-least-once, as a forward is deterministic.

`pick` (the choice) and `usable` (the table) are pure, so they are tested without sockets; `Routes` holds one DEALER
per worker and its monitor: a route is used only once its handshake is done (until then the attempt goes to the
broker), and a dropped connection re-sends at once what was on it. Not ZMQ_IMMEDIATE, which would do the first by
itself: it also throws away a reply that came just before the connection dropped (a worker that answered its last
request and left), and that reply must count.

Lanes (protocol/lane.py; `lanes=True`): each route to a worker on this host also asks its worker to take requests
through shared memory (again after its connection came back). A first attempt goes on the route's lane when the
worker said yes, the lane is free (one request at a time) and the worker polls its lanes now; else on the socket as
before. Everything else about an attempt is the same: the same request id, the same retries, the same loss when the
connection drops or the worker closes the lane (`take_lost`: re-sent at once through the broker).
"""
from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import zmq
from zmq.utils.monitor import recv_monitor_message

from laya_pool.protocol import routing, wire
from laya_pool.protocol.contract import Reason
from laya_pool.protocol.lane import Lane, lane_of, lane_rid, supported

from .retry import reply_error

RING_IT = object()        # `Routes.on_lane`: taken, and its worker must be rung
REFRESH_S = 5.0          # the table is asked for again this often (workers come, go and restart on new ports)
RETRY_S = 1.0            # ... and this soon after a route failed (a broker that did not answer: REFRESH_S, since
                         # each unanswered question costs its caller the question's timeout)
ROUTES_TIMEOUT_S = 0.5     # how long a call waits for the broker's table of direct routes before going without
SEND_HWM = 64            # requests queued towards one worker before a send is refused (and goes to the broker)
_LEAVING = (Reason.STOPPING, Reason.WORKER_FAULT)   # a worker's replies that say it is going: send it nothing more


@dataclass
class Route:
    """One worker's direct socket, from this client."""
    worker: str
    endpoint: str
    sock: Any = None
    mon: Any = None
    inflight: dict[int, float] = field(default_factory=dict)   # request ids sent here and not answered: when
    credit: int = 1           # (a client does not know its worker's credit: each of its requests counts one)
    last_dispatch: float = 0.0    # when this client last sent it an attempt (ties go to the least recent)
    heard: float = float("-inf")   # when a message last came from this worker (alive, if slow, since then)
    up: bool = True           # False once its connection dropped or it refused as stopping (until the table drops it)
    connected: bool = False   # its handshake is done and no disconnect followed (from its monitor's events)
    lane: Lane | None = None  # asked for (or open, `lane_open`) on this worker
    lane_open: bool = False   # the worker took the lane
    lane_rid: int | None = None   # the request on the lane, until its answer is read
    lane_refused: bool = False    # the worker refused a lane (it takes none): this route asks for none again
    key: str = ""             # the worker's CURVE key (z85) in a pool with keys: the socket authenticates it
    local: bool = True        # the worker is on this host (only such a worker can take a lane)
    together: bool = False    # a reply on this route said its worker takes REQUESTS messages (`wire.TOGETHER`)


def _usable(r: Route) -> bool:
    return r.up and r.connected


def pick(routes: Sequence[Route], turn: int, policy: routing.Policy | None = None) -> Route | None:
    """The route the pool's routing policy (protocol/routing.py) chooses among the usable ones (up, connected), by
    this client's requests in flight on each: ties to the one it sent to least recently, then from `turn` on."""
    return (policy or routing.policy())(routes, turn, _usable)


class Target(NamedTuple):
    """Where a route goes: the worker's endpoint, its CURVE key ("" without keys), whether it is on this host."""
    endpoint: str
    key: str
    local: bool


def usable(table: Any, host: str, curve: bool = False) -> dict[str, Target]:
    """{worker: target} from the broker's `routes` ([worker, endpoint, host, key] each). Without a key: only workers
    on this host at loopback endpoints (a broker's word is not taken for anything else). With one (a pool with keys;
    `curve`: this client has them): a tcp endpoint, since the socket authenticates the worker by it; from another
    host not a loopback or wildcard one (that worker listens where this host cannot reach it: its loopback would be
    this host's), and an ipc endpoint only on this host."""
    out: dict[str, Target] = {}
    if not isinstance(table, list):
        return out
    for row in table:
        if not (isinstance(row, list) and len(row) in (3, 4) and all(isinstance(x, str) for x in row)):
            continue
        worker, endpoint, where = row[:3]
        key = row[3] if len(row) == 4 else ""
        local = where == host
        if key:
            reachable = local or (endpoint.startswith("tcp://") and not wire.is_loopback(endpoint)
                                  and not wire.is_unspecified(endpoint))
            if curve and wire.is_curve_key(key) and reachable:
                out[worker] = Target(endpoint, key, local)
        elif local and wire.is_loopback(endpoint):
            out[worker] = Target(endpoint, "", True)
    return out


class Routes:
    """The direct sockets of one client (not thread-safe: the client's lock covers it, or its event loop).

    The blocking client polls them with its own `poller`; the asyncio client gives none, and `watch(route)` /
    `unwatch(route)` start and stop the tasks that read a route's socket and monitor (called as a route opens and
    before it closes)."""

    def __init__(self, ctx: zmq.Context, poller: zmq.Poller | None, max_message_bytes: int, host: str | None = None,
                 watch: Callable[[Route], None] | None = None, unwatch: Callable[[Route], None] | None = None,
                 lanes: bool = False, keys: str | None = None, key_role: str = "client"):
        self.ctx, self.poller, self.max_message_bytes = ctx, poller, max_message_bytes
        self.keys, self.key_role = keys, key_role     # the client's own CURVE keys: routes with a key need them
        self.watch, self.unwatch = watch, unwatch
        self.host = host or socket.gethostname()
        self.routes: dict[str, Route] = {}
        self.by_rid: dict[int, Route] = {}
        self.by_socket: dict[Any, Route] = {}
        self.next_ask = 0.0       # when to ask the broker for the table again
        self.turn = 0
        self.policy = routing.policy()
        self.sent = 0             # attempts that went direct (for tests and stats)
        self.dropped = 0          # ... and were on a connection that dropped (each went again through the broker)
        self.lanes = lanes and supported()
        # A client that reads its routes through watchers (the asyncio client) never polls or sleeps on a lane: every
        # answer there is also rung on the route's socket (the answer stays in shared memory, only the ring travels).
        self.ring_answers = watch is not None
        self.asks: list[tuple[Route, list[Any]]] = []     # the asyncio client's LANE requests (`take_asks`)
        self.on_lanes = 0         # attempts that went on a lane
        self.waiting: list[Route] = []     # routes whose lane carries a request not yet answered
        self.lost: list[int] = []          # requests on closed lanes or routes, to re-send (`take_lost`)

    def due(self, now: float) -> bool:
        return now >= self.next_ask

    def asked(self, table: Any, now: float) -> None:
        """The broker's table (None: it did not answer): open what is new, close what is gone or moved."""
        self.next_ask = now + REFRESH_S
        if table is None:
            return
        want = usable(table, self.host, curve=self.keys is not None)
        for worker, r in list(self.routes.items()):
            if want.get(worker) != Target(r.endpoint, r.key, r.local):
                self._close(r)
            else:
                r.up = True       # ready again by the broker's word (a dead one's connection stays down: unused)
                if r.connected and self._wants_lane(r):
                    self._ask_lane(r)     # its worker closed the last one (room, a restart): at most once a table
        for worker, target in want.items():
            if worker not in self.routes:
                self._open(worker, target)

    def choose(self) -> Route | None:
        routes = list(self.routes.values())
        if not routes:
            return None
        self.turn += 1
        return pick(routes, self.turn, self.policy)

    def send(self, rid: int, frames: list[Any]) -> bool:
        """Send one attempt of request `rid` to a worker directly; False: none could take it (go to the broker)."""
        r = self.choose()
        if r is None:
            return False
        if r.lane_open and r.lane_rid is None:
            took = self.on_lane(r, rid, frames)
            if took:
                if took is RING_IT:
                    self._ring(r)
                return True
        try:
            wire.send_frames(r.sock, frames, copy=False)
        except zmq.Again:           # its queue is full (SEND_HWM)
            return False
        self.took(r, rid)
        return True

    def took(self, r: Route, rid: int) -> None:
        """Request `rid`'s attempt went to route `r` (sent by the caller: the asyncio client sends through its own
        view of the socket)."""
        r.inflight[rid] = r.last_dispatch = time.monotonic()
        self.by_rid[rid] = r
        self.sent += 1

    def unsent(self, rid: int) -> None:
        """Request `rid`, counted by `took`, did not leave after all (the socket's queue was full): it goes on
        elsewhere, and the worker is not to blame."""
        if self.by_rid.get(rid) is not None:
            self.detach(rid)
            self.sent -= 1

    def answered(self, rid: Any, status: Any = None, reason: Any = None) -> None:
        """A reply to `rid` came (from wherever): forget where it went. A worker that says it is stopping is not
        sent more until the table says it is back."""
        r = self.by_rid.pop(rid, None) if isinstance(rid, int) else None
        if r is None:
            return
        r.inflight.pop(rid, None)
        self._unwait(r, rid)
        if status == wire.STATUS_RETRYABLE and reason in _LEAVING:
            self._fail(r)

    def replied(self, header: dict) -> None:
        """`answered` from a reply's header (whichever socket or lane it came on), or a lane's own message."""
        name = lane_of(header.get("rid"))
        if name is not None:
            self._lane_said(name, header)
            return
        err = reply_error(header) or {}
        self.answered(header.get("rid"), header.get("status"), err.get("reason"))

    def heard_from(self, r: Route) -> None:
        """A message came from route `r`'s worker (on its socket or its lane, an answer to any attempt, late ones too):
        it is alive. Not a call that ended without one (`answered` with no reply)."""
        r.heard = time.monotonic()

    def detach(self, rid: int, blame: bool = False) -> None:
        """Request `rid` goes on elsewhere (a retry through the broker): forget its direct attempt; with `blame`
        (that attempt heard nothing) send that worker nothing more until the table lists it again, unless a message
        came from it since this attempt went out (`heard_from`): then it is alive and the attempt only waited in its
        queue, and sending every request through the broker for a second would add the broker's hops to a busy pool's
        load."""
        r = self.by_rid.pop(rid, None)
        if r is not None:
            sent = r.inflight.pop(rid, float("-inf"))
            self._unwait(r, rid)
            if blame and r.heard < sent:
                self._fail(r)

    def events(self, mon: Any) -> list[int]:
        """Read a route's monitor; the request ids that were out on it when its connection dropped (re-send them)."""
        r = self.by_socket.get(mon)
        lost: list[int] = []
        while True:
            try:
                ev = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return lost
            if r is not None and ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                r.connected = True
                if self._wants_lane(r):
                    self._ask_lane(r)         # the connection came back (the first is asked for at `_open`)
            elif r is not None and ev["event"] == zmq.EVENT_DISCONNECTED:
                r.connected = False
                lost.extend(r.inflight)
                self.dropped += len(r.inflight)
                for rid in r.inflight:
                    self.by_rid.pop(rid, None)
                r.inflight.clear()
                self._drop_lane(r)        # its worker may be gone: what was on the lane is lost with the rest
                self._fail(r)

    # -- lanes ----------------------------------------------------------------------------------------------
    def lane_ready(self) -> bool:
        """A lane has its request's answer, or its worker closed it."""
        return any(r.lane.free() or r.lane.gone() for r in self.waiting)

    def answers(self) -> list[list[bytes]]:
        """The answers the lanes have (each a message's frames; what went over a socket instead comes there); a
        request on a lane its worker closed unanswered is lost (`take_lost`)."""
        out = []
        for r in [r for r in self.waiting if r.lane.free() or r.lane.gone()]:
            self.waiting.remove(r)
            rid, r.lane_rid = r.lane_rid, None
            frames = r.lane.answer()
            if frames is not None:
                self.heard_from(r)
            if frames:
                out.append(frames)
            elif frames is None:          # gone, unanswered
                self.by_rid.pop(rid, None)
                r.inflight.pop(rid, None)
                self.lost.append(rid)
                self.dropped += 1
            if r.lane.gone():
                self._drop_lane(r)
        return out

    def _unwait(self, r: Route, rid: int) -> None:
        """Request `rid` is answered elsewhere or given up: stop waiting on its lane (an answer that still comes there
        is never read; the next `usable` waits for it)."""
        if r.lane_rid == rid:
            self.waiting.remove(r)
            r.lane_rid = None

    def take_lost(self) -> list[int]:
        """Requests whose lane their worker closed before answering, or whose route closed (the table dropped it):
        re-send them (as a dropped connection's)."""
        lost, self.lost = self.lost, []
        return lost

    def on_lane(self, r: Route, rid: int, frames: list[Any]) -> object:
        """Request `rid`'s attempt on route `r`'s lane, if the lane can take it now (its lane open and free): False
        (not taken), True, or RING_IT (taken, but its worker fell asleep as we wrote: send it `ring(r)` on the route's
        socket; module docstring of protocol/lane.py)."""
        lane = r.lane
        if lane.gone():
            self._drop_lane(r)            # asked for again with the next table (`asked`)
            return False
        if not lane.usable() or lane.ask(frames) is None:
            return False
        r.lane_rid = rid
        self.waiting.append(r)
        self.on_lanes += 1
        self.took(r, rid)
        return True if lane.worker_awake() else RING_IT

    @staticmethod
    def ring(r: Route) -> list[Any]:
        """The message that wakes route `r`'s worker to read its lane."""
        return wire.encode(wire.Cmd.LANE, {"rid": lane_rid(r.lane.name), "ring": True})

    def _ring(self, r: Route) -> None:
        try:
            wire.send_frames(r.sock, self.ring(r))
        except zmq.Again:
            pass                      # its queue is full: it is awake enough

    def _wants_lane(self, r: Route) -> bool:
        return self.lanes and r.local and r.lane is None and not r.lane_refused

    def _ask_lane(self, r: Route) -> None:
        try:
            r.lane = Lane.create()
        except OSError:
            self.lanes = False        # no room or no /dev/shm for us: sockets only
            return
        r.lane.ring_me(self.ring_answers)
        ask = wire.encode(wire.Cmd.LANE, {"rid": lane_rid(r.lane.name), "lane": r.lane.name,
                                          "secret": r.lane.secret()})
        if self.watch is not None:
            # The asyncio client sends through its view of the socket (`take_asks`): a send on the plain socket may
            # take the readiness its reader waits on.
            self.asks.append((r, ask))
            return
        try:
            wire.send_frames(r.sock, ask)
        except zmq.Again:
            self._drop_lane(r)

    def unask(self, r: Route) -> None:
        """Route `r`'s lane request could not be sent: no lane (asked for again with a later table)."""
        self._drop_lane(r)

    def take_asks(self) -> list[tuple[Route, list[Any]]]:
        """The asyncio client's lane requests to send (each on its route's socket), made since it last took them."""
        asks, self.asks = [(r, a) for r, a in self.asks if self.routes.get(r.worker) is r and r.lane is not None], []
        return asks

    def _lane_said(self, name: str, header: dict) -> None:
        r = next((r for r in self.routes.values() if r.lane is not None and r.lane.name == name), None)
        if r is None:
            return
        if header.get("status") == wire.STATUS_OK:
            r.lane_open = True        # (the worker unlinked its name on opening it)
        else:
            # Final: this worker takes no lanes (its socket it is); retryable: none free now (asked again with the
            # next table).
            self._drop_lane(r, refused=header.get("status") != wire.STATUS_RETRYABLE)

    def _drop_lane(self, r: Route, refused: bool = False) -> None:
        if r.lane is None:
            return
        if r in self.waiting:
            self.waiting.remove(r)
        r.lane.unlink()
        r.lane.close(say=True)
        r.lane, r.lane_open, r.lane_rid = None, False, None
        r.lane_refused = r.lane_refused or refused

    def owner(self, sock: Any) -> Route | None:
        return self.by_socket.get(sock)

    def close(self) -> None:
        for r in list(self.routes.values()):
            self._close(r)

    # -- inside ---------------------------------------------------------------------------------------------
    def _open(self, worker: str, target: Target) -> None:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, SEND_HWM)
        s.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        if target.key:
            # The worker proves it holds the key the broker's table gave; the client, that it holds an admitted one.
            wire.configure_curve_client(s, self.keys, self.key_role, server_key=target.key.encode())
        mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        s.connect(target.endpoint)
        r = Route(worker, target.endpoint, s, mon, key=target.key, local=target.local)
        self.routes[worker] = r
        self.by_socket[s] = self.by_socket[mon] = r
        if self._wants_lane(r):
            self._ask_lane(r)
        if self.poller is not None:
            self.poller.register(s, zmq.POLLIN)
            self.poller.register(mon, zmq.POLLIN)
        if self.watch is not None:
            self.watch(r)

    def _fail(self, r: Route) -> None:
        r.up = False
        self.next_ask = min(self.next_ask, time.monotonic() + RETRY_S)

    def _close(self, r: Route) -> None:
        self._drop_lane(r)
        # What is out on it will not be answered here (its socket closes): re-sent at once, as a dropped connection's.
        self.lost.extend(r.inflight)
        self.dropped += len(r.inflight)
        for rid in r.inflight:
            self.by_rid.pop(rid, None)
        try:
            r.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        if self.unwatch is not None:
            self.unwatch(r)           # (closing its readers may close the sockets themselves)
        for s in (r.sock, r.mon):
            if self.poller is not None:
                self.poller.unregister(s)
            self.by_socket.pop(s, None)
            if not s.closed:
                s.close(0)
        self.routes.pop(r.worker, None)
