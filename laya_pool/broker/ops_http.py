"""The operations HTTP endpoint (`--http [HOST:]PORT` of `laya-pool up`, `broker` and `workers`): /metrics,
/health/live, /health/ready.

The I/O half of the operations surface: what to say comes from an observer (a pool's: broker/observe.py; a worker
host's: broker/host.py). Served by one thread of the supervisor (or broker) process, so it answers while the
supervisor runs, also while the broker is down or restarting: then /health/ready says so.

Any local user can connect to it, so what a connection may cost is bounded (docs/reliability.md, issue #54):
- one thread and one selector loop for every connection (no thread per connection);
- at most `MAX_CONNECTIONS` open at once: a new one beyond them closes the oldest still sending its request (idle or
  slow), so a flood of idle connections can neither exhaust the process's file descriptors (which a supervisor's
  worker restarts need) nor keep a prober out;
- a request must arrive whole within `REQUEST_S` of the accept, and its reply leave within `REPLY_S`; a request
  larger than `MAX_REQUEST_BYTES` is refused (431); one reply per connection (`Connection: close`);
- out of file descriptors, an accept takes the oldest connection's, or the one held in reserve for that, so
  /health/live still answers;
- a peer that aborts, garbles or times out costs one log line a second per cause at most, with a count
  (`LogLimiter`).
"""
from __future__ import annotations

import collections
import errno
import json
import logging
import os
import select
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from laya_pool.protocol.listen import family as _family
from laya_pool.protocol.listen import is_loopback_host, parse_listen

from .monitor import LogLimiter
from .observe import Observer

log = logging.getLogger("laya-pool.http")

MAX_CONNECTIONS = 64        # scrapers and probes are a handful; each connection holds a file descriptor
REQUEST_S = 2.0             # from the accept to the end of the request's headers (an idle or slow request is closed)
REPLY_S = 2.0               # for the reply to leave (a peer that does not read it is closed)
MAX_REQUEST_BYTES = 8192    # a GET's request line and headers
TICK_S = 0.25               # how often deadlines are looked at
ACCEPT_BATCH = 16           # connections accepted between two looks at the open ones
BACKLOG = 1024              # connections the kernel completes before an accept (a burst beyond it retries in 1 s)
PATHS = ["/metrics", "/health/live", "/health/ready"]
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 503: "Service Unavailable"}
_NO_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def refusal(listen: str, keys: str | None) -> str | None:
    """Why `laya-pool up --http LISTEN` must not start, or None. Like the frontend, a non-loopback address
    needs CURVE keys: the pool is then meant to be reachable, and its operator chose so explicitly."""
    try:
        host, _ = parse_listen(listen)
    except ValueError as e:
        return str(e)
    if not is_loopback_host(host) and not keys:
        return (f"refusing to serve --http on {host}: not a loopback address and no CURVE keys "
                "(generate them with `laya-pool keys --out DIR`, then pass --keys DIR)")
    return None


class _Collector(Collector):
    def __init__(self, observer: Observer):
        self.observer = observer

    def collect(self) -> Any:
        return self.observer.families(time.monotonic())


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    deadline: float
    request: bytearray = field(default_factory=bytearray)
    reply: memoryview | None = None        # set once the request is whole: what is left to send


class MetricsServer:
    """Binds at construction (so a taken port fails `laya-pool up` at once); serves from one daemon thread."""

    def __init__(self, listen: str, observer: Observer):
        host, port = parse_listen(listen)
        self.observer = observer
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(observer))
        self.listener = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind((host, port))
            self.listener.listen(BACKLOG)
            self.listener.setblocking(False)
        except OSError:
            self.listener.close()
            raise
        self.address = self.listener.getsockname()[:2]
        self.say = LogLimiter(log, interval_s=1.0)
        self.conns: collections.OrderedDict[int, _Conn] = collections.OrderedDict()   # by fd, oldest accept first
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.waiting = select.poll()           # (a poll object holds no descriptor, unlike the selector)
        self.waiting.register(self.listener, select.POLLIN)
        self.accept_paused_until = 0.0
        self.reserve: int | None = None        # a descriptor held back for an accept when none is left
        self._reopen_reserve()
        self.wake_r, self.wake_w = socket.socketpair()
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, name="laya-pool-http", daemon=True)
        self.thread.start()
        log.info("metrics and health on http://%s:%d (/metrics, /health/live, /health/ready)", host, self.address[1])

    # -------------------------------------------------------------------------------------------- the loop

    def _serve(self) -> None:
        while not self.stopping:
            try:
                events = self.selector.select(TICK_S)
            except OSError as e:       # (EINTR is retried by selectors; anything else: say it, keep the loop)
                self.say("select", logging.ERROR, "the HTTP endpoint's poll failed: %s", e)
                time.sleep(TICK_S)
                continue
            for key, mask in events:
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj is self.wake_r:
                    continue
                else:
                    self._on_ready(key.data, mask)
            now = time.monotonic()
            self._expire(now)
            self._resume_accepts(now)
            self.say.flush()

    def _accept(self) -> None:
        """The connections waiting, each in a slot (the oldest sending its request gives up its own beyond the
        bound), until none is left, no descriptor is to be had or `ACCEPT_BATCH` are in: then the loop reads what
        came on those (a prober's request is answered before a flood behind it can take its slot)."""
        # Asked before each accept: out of descriptors, Linux fails an accept with EMFILE before it looks for a
        # connection, so the error alone does not say that one is waiting (and an eviction would be for nothing).
        for _ in range(ACCEPT_BATCH):
            if not self.waiting.poll(0):
                return
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in _NO_FDS and self._free_a_descriptor():
                    continue
                self._pause_accepts(e)
                return
            if len(self.conns) >= MAX_CONNECTIONS and not self._evict("the connection limit"):
                sock.close()           # every slot is sending a reply: this one waits for none
                self.say("full", logging.WARNING, "HTTP endpoint: refused a connection (all %d slots are sending "
                         "replies)", MAX_CONNECTIONS)
                continue
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic() + REQUEST_S)
            self.conns[sock.fileno()] = conn
            self.selector.register(sock, selectors.EVENT_READ, conn)

    def _on_ready(self, conn: _Conn, mask: int) -> None:
        try:
            if conn.reply is None and mask & selectors.EVENT_READ:
                self._read(conn)
            elif conn.reply is not None and mask & selectors.EVENT_WRITE:
                self._write(conn)
        except BlockingIOError:        # woken for nothing, or the peer's buffer is full: the selector calls again
            return
        except OSError as e:           # reset, broken pipe: the peer went away mid-request
            self._drop(conn, "aborted", f"the peer broke the connection ({e.strerror or e})")

    def _read(self, conn: _Conn) -> None:
        data = conn.sock.recv(4096)
        if not data:
            if conn.request:
                self._drop(conn, "aborted", "the peer closed the connection mid-request")
            else:
                self._close(conn)      # a port probe: nothing to say
            return
        conn.request += data
        end = conn.request.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.request) > MAX_REQUEST_BYTES:
                self._answer(conn, 431, _json({"error": f"request headers over {MAX_REQUEST_BYTES} bytes"}),
                             cause="too-large")
            return
        self._answer(conn, *self._respond(bytes(conn.request[:end])))

    def _respond(self, head: bytes) -> tuple[int, tuple[bytes, str], bool, str | None]:
        """(status, (body, content type), whether the method is HEAD, the cause to log or None)."""
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, _json({"error": "malformed request line"}), False, "malformed"
        method, target = parts[0], parts[1].decode("latin-1").split("?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return 405, _json({"error": "only GET and HEAD"}), False, "method"
        head_only = method == b"HEAD"
        if target == "/metrics":
            return 200, (generate_latest(self.registry), CONTENT_TYPE_LATEST), head_only, None
        if target == "/health/live":
            return 200, _json({"live": True}), head_only, None
        if target == "/health/ready":
            ready, body = self.observer.readiness(time.monotonic())
            return 200 if ready else 503, _json(body), head_only, None
        return 404, _json({"error": "not found", "paths": PATHS}), head_only, None

    def _answer(self, conn: _Conn, code: int, body: tuple[bytes, str], head_only: bool = False,
                cause: str | None = None) -> None:
        if cause is not None:
            self.say(cause, logging.INFO, "HTTP endpoint: answered %d to a %s request", code, cause)
        data, content_type = body
        reply = (f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\nContent-Type: {content_type}\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode("latin-1")
        conn.reply = memoryview(reply if head_only else reply + data)
        conn.deadline = time.monotonic() + REPLY_S
        self.selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        try:
            self._write(conn)
        except BlockingIOError:
            pass                       # the rest goes when the peer's buffer has room

    def _write(self, conn: _Conn) -> None:
        sent = conn.sock.send(conn.reply)
        conn.reply = conn.reply[sent:]
        if not conn.reply:
            self._close(conn)

    # -------------------------------------------------------------------------------------------- bounds

    def _expire(self, now: float) -> None:
        for conn in [c for c in self.conns.values() if now > c.deadline]:
            if conn.reply is None:
                self._drop(conn, "timeout", f"closed a connection that sent no whole request within {REQUEST_S:g} s")
            else:
                self._drop(conn, "slow-reader", f"closed a connection that did not read its reply within {REPLY_S:g} s")

    def _evict(self, why: str) -> bool:
        """Close the oldest connection still sending its request (idle or slow); False when every one is replying."""
        victim = next((c for c in self.conns.values() if c.reply is None), None)
        if victim is None:
            return False
        self._drop(victim, "evicted", f"closed the oldest connection still sending its request ({why}: at most "
                   f"{MAX_CONNECTIONS} at once)")
        return True

    def _free_a_descriptor(self) -> bool:
        """Out of file descriptors: give up the oldest connection's, or the one held in reserve."""
        if self._evict("out of file descriptors"):
            return True
        if self.reserve is not None:
            os.close(self.reserve)
            self.reserve = None
            return True
        return False

    def _pause_accepts(self, e: OSError) -> None:
        """Nothing to free: stop looking at the listener for a tick (it stays readable; polling it would spin)."""
        self.say("accept", logging.ERROR, "HTTP endpoint: could not accept a connection (%s)%s", e.strerror or e,
                 ": out of file descriptors (raise `ulimit -n`)" if e.errno in _NO_FDS else "")
        if not self.accept_paused_until:
            self.selector.unregister(self.listener)
        self.accept_paused_until = time.monotonic() + TICK_S

    def _resume_accepts(self, now: float) -> None:
        self._reopen_reserve()
        if self.accept_paused_until and now >= self.accept_paused_until:
            self.accept_paused_until = 0.0
            self.selector.register(self.listener, selectors.EVENT_READ)

    def _reopen_reserve(self) -> None:
        if self.reserve is None:
            try:
                self.reserve = os.open(os.devnull, os.O_RDONLY)
            except OSError:
                self.reserve = None

    def _drop(self, conn: _Conn, cause: str, what: str) -> None:
        self.say(cause, logging.INFO, "HTTP endpoint: %s", what)
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self.conns.pop(conn.sock.fileno(), None) is not None:
            self.selector.unregister(conn.sock)
        conn.sock.close()
        self._reopen_reserve()

    def close(self) -> None:
        self.stopping = True
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(5)
        for conn in list(self.conns.values()):
            self._close(conn)
        self.selector.close()
        for s in (self.listener, self.wake_r, self.wake_w):
            s.close()
        if self.reserve is not None:
            os.close(self.reserve)
            self.reserve = None


def _json(body: dict[str, Any]) -> tuple[bytes, str]:
    return (json.dumps(body, sort_keys=True) + "\n").encode(), "application/json"
