"""What the client's connection to the pool is doing, from its socket's ZeroMQ monitor events.

Two things a call cannot learn from its own socket:
- the connection dropped and came back (a broker restarted: the new one never saw the requests in flight),
  so waiting out the timeout is pointless: the call re-sends at once (same request id);
- the pool refuses the handshake (a client without CURVE keys, or with a key the pool does not admit), so
  the error can say what to fix instead of "no reply" or "the send queue is full".

`ConnectionWatch.feed` is pure (events in, verdicts out), so the rules are tested without sockets.
"""
from __future__ import annotations

import zmq

# A waiting call's wake-up: the connection came back (a new broker, or the worker its attempt went to died with it),
# so what was sent is lost: re-send now (`Client._wait`, `AsyncClient`'s waiters).
RECONNECTED = object()

EVENTS = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

_REFUSED = {
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the pool refused the connection's security handshake: it expects CURVE "
                                         "keys (pass keys=DIR from `laya-pool keys`) or the client has keys the "
                                         "pool does not use",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the pool refused this client's CURVE key: ask the operator to add its public "
                                     "key to the key directory's authorized/ folder",
    # A keyless client refused by a CURVE pool sees this or the PROTOCOL event, whichever end breaks off first
    # (a race: tests/test_security_roles.py saw both), so the advice names both causes.
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the connection's handshake failed: the pool expects CURVE keys (pass "
                                          "keys=DIR from `laya-pool keys`), or the endpoint is not a laya-pool broker",
}


class ConnectionWatch:
    def __init__(self) -> None:
        self.up = False            # a handshake has succeeded and no disconnect followed
        self.dropped = False       # a connection was lost since the last handshake
        self.trouble: str | None = None   # why the pool refuses us, while it does

    def feed(self, event: int) -> bool:
        """Take one event; True when the connection came back after a drop (re-send what is in flight)."""
        if event == zmq.EVENT_DISCONNECTED:
            self.dropped = self.dropped or self.up
            self.up = False
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            back = self.dropped
            self.up, self.dropped, self.trouble = True, False, None
            return back
        elif event in _REFUSED:
            self.trouble = _REFUSED[event]
        return False
