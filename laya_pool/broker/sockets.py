"""The broker's two ROUTER sockets (clients on the frontend, workers on the backend) and how it sends on them.

A send never waits: a peer that is gone or not reading (its queue of `client_hwm` replies is full) loses the
message, counted and logged once in a while, so one slow peer cannot stop the broker or grow its memory.
"""
from __future__ import annotations

import logging
import os
import time
import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

from laya_pool.protocol import wire
from laya_pool.protocol.wire import Cmd

from . import security
from .config import BrokerConfig
from .metering import Meter
from .monitor import LogLimiter, SocketWatch
from .replies import frames_bytes
from .table import WorkerInfo
from .unread import Unread, probe, trim

_MORE = wire.DONTWAIT | wire.SNDMORE
PEER_BUFFER_BYTES = 256 << 20   # what one peer's messages waiting to be read may hold, at the largest frame
MIN_RCVHWM = 16


def receive_hwm(max_frame: int) -> int:
    """ZMQ_RCVHWM sized in bytes: PEER_BUFFER_BYTES of messages (a header and a frame of `max_frame`), at least
    MIN_RCVHWM (16 MiB frames: 16 messages; it was 100,000 of any size). The broker reads every socket at once, so
    its queues are rarely more than a few messages deep (16 or 100,000 carried the same small-message rate)."""
    return max(MIN_RCVHWM, PEER_BUFFER_BYTES // (wire.MAX_HEADER_BYTES + max_frame))


class Sockets:
    def __init__(self, cfg: BrokerConfig, ctx: zmq.Context, counters: Counter, meter: Meter, say: LogLimiter,
                 users: bool = False):
        """`users`: note who sent each frontend message (`peer_user`, the CURVE key; operator commands need it)."""
        self.cfg, self.ctx, self.counters, self.meter, self.say, self.users = cfg, ctx, counters, meter, say, users
        self.auth = None
        self.frontend = self._router(cfg.frontend, cfg.max_frontend_bytes, handover=False, role="clients",
                                     hwm=cfg.client_hwm)
        # No ROUTER_HANDOVER: a second connection with a live worker's identity would take its route over (and its
        # requests with it) before any READY were read; ZeroMQ now ignores it, and a READY for a live worker's id from
        # another socket is refused (broker/workers.py `on_ready`).
        self.backend = self._router(cfg.backend, cfg.max_backend_bytes, handover=False, role="workers")
        self._send_frontend, self._send_backend = _frame_sender(self.frontend), _frame_sender(self.backend)
        self.watches = [SocketWatch(self.frontend, "frontend", say), SocketWatch(self.backend, "backend", say)]
        self.peer_user: str | None = None       # the CURVE key of the frontend message being handled
        self.unread = Unread(cfg.unread_max_bytes)     # replies clients have not taken yet (broker/unread.py)

    def _router(self, endpoint: str, max_bytes: int, handover: bool, role: str, hwm: int = 100_000) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if handover:
            s.setsockopt(zmq.ROUTER_HANDOVER, 1)
        s.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, hwm)     # per peer: a peer that never reads cannot grow the broker past it
        s.setsockopt(zmq.RCVHWM, receive_hwm(max_bytes))
        if self.cfg.keys:
            if self.auth is None:
                self.auth = security.start_authenticator(self.ctx, self.cfg.keys)
            # Each socket authenticates its own kind of peer: a client key cannot register as a worker.
            security.curve_server(s, self.cfg.keys, role)
        if endpoint.startswith("ipc://"):
            os.makedirs(os.path.dirname(endpoint[len("ipc://"):]) or ".", exist_ok=True)
            security.ipc_free(endpoint)     # ZeroMQ would unlink a live pool's socket and take its place
        s.bind(endpoint)
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://"):], 0o600)   # only this user's processes may connect
        return s

    def receiver(self, sock: zmq.Socket) -> Callable[[zmq.Socket], list[bytes]]:
        """How to read `sock`'s messages: the frontend's noting their sender when operator commands need it."""
        return self._recv_with_user if sock is self.frontend and self.users else wire.recv_frames

    def _recv_with_user(self, sock: zmq.Socket) -> list[bytes]:
        # Under CURVE, who sent it (the authenticated key) decides whether it may drain a worker.
        first = sock.recv(zmq.NOBLOCK, copy=False)
        try:
            self.peer_user = first.get("User-Id")
        except zmq.ZMQError:
            self.peer_user = None
        return [first.bytes, *sock.recv_multipart()] if first.more else [first.bytes]

    def send(self, sock: zmq.Socket, frames: list[Any]) -> bool:
        """One message without waiting; False when its peer is gone or its queue is full."""
        send = self._send_frontend if sock is self.frontend else self._send_backend
        try:
            # Frame by frame with plain-int flags, through pyzmq's compiled send (`_frame_sender`). Only the first
            # frame can fail: once it is taken, ZeroMQ takes the rest.
            for f in frames[:-1]:
                send(f, _MORE)
            send(frames[-1], wire.DONTWAIT)
            return True
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise

    # -------------------------------------------------------------------------------------------- clients

    def to_client(self, envelope: list[bytes], frames: list[Any], shared: int = 0) -> None:
        """`shared`: bytes of `frames` that are one buffer for every send (the model card), not counted as unread."""
        peer, n, now = envelope[0], frames_bytes(frames) - shared, time.monotonic()
        if not self.unread.admit(peer, n, now):
            # It has not read what it was sent, and the replies no client has read are at their bound (all clients).
            self.counters["unread_full"] += 1
            self.say("unread-full", logging.WARNING, "dropped a reply to a client that has not read %d bytes of "
                     "earlier replies: replies unread by all clients are at --unread-max-bytes (%d)",
                     self.unread.held(peer), self.cfg.unread_max_bytes)
            return
        if self.unread.probe_due(now):
            self.unread.probed(probe(), now)
        if self.unread.mark_due(peer, now):
            tracker = self._send_tracked(envelope, frames)
            sent = tracker is not None
        else:
            tracker, sent = None, self.send(self.frontend, envelope + frames)
        if not sent:
            # Gone, or not reading: its queue (client_hwm replies) is full. Dropped, so memory stays bounded.
            self.counters["client_gone"] += 1
            self.say("client-hwm", logging.WARNING, "dropped a reply: the client is gone or not reading its replies "
                     "(%d queued at most per client; --client-hwm)", self.cfg.client_hwm)
            return
        self.unread.add(peer, n, now, tracker)

    def _send_tracked(self, envelope: list[bytes], frames: list[Any]) -> Any:
        """`send` on the frontend, its first frame after the envelope tracked (ZeroMQ says when it let go of the
        message: `Unread`, which asks for one now and then); the tracker, or None when the client is gone or its queue
        is full."""
        send = self._send_frontend
        first = frames[0]
        # Not copied (pyzmq copies a small frame, and a copied frame's tracker is done at once): ZeroMQ holds this
        # buffer until it lets go of the message.
        first = zmq.Frame(bytes(first) if isinstance(first, zmq.Frame) else first, track=True, copy=False)
        try:
            for f in envelope:
                send(f, _MORE)
            tracker = send(first, _MORE if len(frames) > 1 else wire.DONTWAIT, False, True)
            for f in frames[1:-1]:
                send(f, _MORE)
            if len(frames) > 1:
                send(frames[-1], wire.DONTWAIT)
            return tracker
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return None
            raise

    def housekeeping(self, now: float) -> None:
        """Count off the replies clients took (or left behind), and give the heap back once much of it went."""
        self.unread.settle(now)
        if self.unread.trim_due(now):
            trim()

    def client_error(self, envelope: list[bytes], rid: Any, status: str, message: str, *, field: str | None = None,
                     row: int | None = None, cmd: Cmd = Cmd.REPLY, reason: str | None = None,
                     retry_after: float | None = None, like: list[Any] | None = None) -> None:
        """`like`: the undecodable message this answers (a LAYA2 peer's gets its answer in LAYA2's layout)."""
        self.counters["errors_" + status] += 1
        if cmd == Cmd.REPLY:
            self.meter.refused(status, reason)
        reply = wire.encode_error(rid, status, message, field=field, row=row, cmd=cmd, reason=reason,
                                  retry_after=retry_after)
        self.to_client(envelope, reply if like is None else wire.in_kind(like, reply))

    # -------------------------------------------------------------------------------------------- workers

    def to_worker(self, w: WorkerInfo, cmd: Cmd, header: dict, *frames: Any) -> bool:
        ok = self.send(self.backend, [w.identity, *wire.encode(cmd, header, *frames)])
        if ok:
            w.last_sent = time.monotonic()
        return ok

    def to_data(self, w: WorkerInfo, frames: list[Any]) -> bool:
        """A request to the worker's data thread, or to its control socket while the data socket is not connected
        (ROUTER_MANDATORY refuses an unknown peer at the first frame, so nothing was sent; the worker's I/O thread
        hands what it gets there to the data thread)."""
        if w.data_requests and self.send(self.backend, [w.data, *frames]):
            return True     # not `last_sent`: the worker's I/O thread hears the broker on its control socket only
        self.counters["routed_to_control"] += w.data_requests
        ok = self.send(self.backend, [w.identity, *frames])
        if ok:
            w.last_sent = time.monotonic()
        return ok

    def disconnect(self, identity: bytes, reason: str, like: list[bytes] | None = None) -> None:
        """Tell a worker to leave (and register again if it wants in). `like`: as in `client_error`."""
        leave = wire.encode(Cmd.DISCONNECT, {"reason": reason})
        self.send(self.backend, [identity, *(leave if like is None else wire.in_kind(like, leave))])

    def close(self) -> None:
        if self.auth is not None:
            wire.stop_authenticator(self.auth)     # (pyzmq's own stop waits forever on a handler that died)
        for watch in self.watches:
            watch.close()
        self.frontend.close(0)
        self.backend.close(0)


def _frame_sender(sock: zmq.Socket) -> Callable[[Any, int], Any]:
    """`sock.send` without pyzmq's Python wrapper around it, which only adds draft-socket options (routing_id,
    group) a ROUTER never uses: 0.14 against 0.32 us a frame, and a routed request is 15 frames out."""
    return types.MethodType(zmq.backend.Socket.send, sock)
