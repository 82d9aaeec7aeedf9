"""What an operator needs to see when a peer cannot get in or is being refused, said once, not a flood.

- `LogLimiter`: one line per kind of trouble per interval, with how many were left unsaid, so a hostile or
  broken peer cannot fill the log (or the disk) while the first line still says what to fix.
- `SocketWatch`: the broker's sockets' ZeroMQ monitor events turned into those lines: refused CURVE
  handshakes (a client without keys, an unknown key, a plain-text peer on a CURVE socket), refused
  connections (the process is out of file descriptors) and dropped connections.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from .ratelimit import RateLimit


class LogLimiter:
    """At most one line per `key` every `interval_s` seconds (broker/ratelimit.py); the next says how many were
    suppressed, and `flush` says it for a key that went quiet."""

    def __init__(self, log: logging.Logger, interval_s: float = 10.0):
        self.log, self.interval_s = log, interval_s
        self.limit = RateLimit(interval_s)

    def __call__(self, key: str, level: int, message: str, *args: Any) -> bool:
        n = self.limit.admit(key, time.monotonic())
        if n is None:
            return False
        tail = f" ({n} more like this in the last {self.interval_s:g} s)" if n else ""
        self.log.log(level, message + tail, *args)
        return True

    def flush(self, level: int = logging.INFO) -> None:
        """One line for each key whose suppressed lines waited a whole interval with none said."""
        for key, n in self.limit.due(time.monotonic()):
            self.log.log(level, "%d more like the last %r line in the last %g s", n, key, self.interval_s)


# Handshake failures, by event: what it means for the operator.
_HANDSHAKE = {
    "HANDSHAKE_FAILED_NO_DETAIL": "the peer broke off the handshake (a port probe, or not a ZeroMQ peer)",
    "HANDSHAKE_FAILED_PROTOCOL": "the peer speaks another security mechanism (a client or worker without "
                                 "CURVE keys, or with keys for another pool)",
    "HANDSHAKE_FAILED_AUTH": "its key is not authorized (not in the key directory's authorized folder)",
}


class SocketWatch:
    """Monitor one socket; `handle()` reads its pending events and logs what an operator must know."""

    def __init__(self, sock: zmq.Socket, role: str, say: LogLimiter):
        self.role, self.say, self.parent = role, say, sock
        events = zmq.EVENT_ACCEPT_FAILED | zmq.EVENT_DISCONNECTED
        for name in _HANDSHAKE:
            events |= getattr(zmq, "EVENT_" + name, 0)
        self.sock = sock.get_monitor_socket(events)
        self.counts: dict[str, int] = {}

    def handle(self) -> None:
        while True:
            try:
                ev = recv_monitor_message(self.sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_event(int(ev["event"]), ev.get("value"), ev.get("endpoint"))

    def on_event(self, event: int, value: Any, endpoint: Any) -> None:
        name = next((n for n in _HANDSHAKE if getattr(zmq, "EVENT_" + n, None) == event), None)
        if name is not None:
            self.counts["refused_handshakes"] = self.counts.get("refused_handshakes", 0) + 1
            level = logging.INFO if name == "HANDSHAKE_FAILED_NO_DETAIL" else logging.WARNING
            self.say(f"{self.role}-{name}", level, "%s socket: refused a connection: %s", self.role, _HANDSHAKE[name])
        elif event == zmq.EVENT_ACCEPT_FAILED:
            self.counts["accept_failed"] = self.counts.get("accept_failed", 0) + 1
            why = ("out of file descriptors: raise `ulimit -n` or find the process holding connections open"
                   if value in (errno.EMFILE, errno.ENFILE) else f"errno {value}")
            self.say(f"{self.role}-accept", logging.ERROR, "%s socket: could not accept a connection (%s)",
                     self.role, why)
        elif event == zmq.EVENT_DISCONNECTED:
            self.counts["disconnects"] = self.counts.get("disconnects", 0) + 1

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.parent.disable_monitor()
        self.sock.close(0)
