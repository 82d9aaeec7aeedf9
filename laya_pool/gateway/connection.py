"""One HTTP connection's bounds, on uvicorn's HTTP/1.1 protocols.

The parser is httptools (llhttp, in C) where it is installed, as uvicorn's own default picks it: before a stub worker
one process answered ~16% more decisions a second than on h11, at ~13% less CPU a request
(docs/decisions/0025-httptools.md). Else h11, in Python (`--http-parser` chooses). Either way the connection:

- sets TCP_NODELAY: headers and body go out in two writes, and with Nagle's algorithm the second waits for the
  client's delayed ACK, 40 ms an answer. asyncio sets it only where the socket reports IPPROTO_TCP;
- is closed when its next request head has not arrived within `read_timeout` of the connection opening or of the
  previous answer: uvicorn starts no timer before a head and resets its keep-alive timer on every byte, so one byte
  every few seconds would hold a connection forever;
- may send a request head of at most MAX_HEAD_BYTES, 16 KiB; past it the answer is 400 and the connection is closed.
  Two checks make it. While a head is incomplete the parser holds it: h11 refuses past 16 KiB itself, and for
  httptools (which uvicorn sets no bound) the bytes read since the head began are counted here. A head that arrives
  whole in one read passes both, so `bounded_heads` measures every complete head (its request target and fields)
  before the app sees it.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Any

MAX_HEAD_BYTES = 16 * 1024
REFUSED = b"Invalid HTTP request received."           # uvicorn's own words for a head it cannot take


def head_bytes(scope: dict[str, Any]) -> int:
    """A request head's size as parsed: method, target, version and every field with its separators."""
    return (len(scope["method"]) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 12
            + sum(len(k) + len(v) + 4 for k, v in scope["headers"]))


def bounded_heads(app: Any) -> Any:
    """`app` behind the head bound: an HTTP request whose head is over MAX_HEAD_BYTES is answered 400 and its
    connection closed, before `app` sees it."""
    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and head_bytes(scope) > MAX_HEAD_BYTES:
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": REFUSED})
            return
        await app(scope, receive, send)
    return asgi


def parser_name() -> str:
    """"httptools" where it is installed, else "h11"."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


class _Bounds:
    """TCP_NODELAY and the head timer, for either protocol (each has `transport`, `loop` and `cycle`)."""
    read_timeout: float = 10.0
    head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():  # type: ignore[attr-defined]
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(self.read_timeout, self._late)  # type: ignore[attr-defined]

    def _late(self) -> None:
        self.head_timer = None
        cycle = self.cycle  # type: ignore[attr-defined]
        in_request = cycle is not None and not cycle.response_complete
        if not in_request and not self.transport.is_closing():  # type: ignore[attr-defined]
            self.transport.close()      # no request head in time: idle, or a head trickling in


def protocol_class(read_timeout: float, parser: str = "auto") -> type:
    """uvicorn's protocol for `parser` (httptools, h11, or auto: `parser_name()`) with this module's bounds."""
    if (parser_name() if parser == "auto" else parser) == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class H11(_Bounds, H11Protocol):           # h11 bounds a head to 16 KiB itself
            pass
        H11.read_timeout = read_timeout
        return H11
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpTools(_Bounds, HttpToolsProtocol):
        unparsed = 0            # bytes read while the head was not whole (-1 once it is: a body may follow)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.unparsed = 0

        def on_headers_complete(self) -> None:
            self.unparsed = -1
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.unparsed >= 0 and not self.transport.is_closing():
                self.unparsed += len(data)            # llhttp holds a field whole until it ends: bound what it holds
                if self.unparsed > MAX_HEAD_BYTES:
                    self.send_400_response(REFUSED.decode())
    HttpTools.read_timeout = read_timeout
    return HttpTools
