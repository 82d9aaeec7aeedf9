"""The gateway process: the app (gateway/app.py) served by uvicorn on one asyncio event loop (no thread per
connection), with the bounds `laya serve` leaves to its deployment.

- The head of every request must arrive within `read_timeout` of the connection opening or of the previous answer;
  else the connection is closed. uvicorn bounds a head's size (h11: 16 KiB), not its time, and resets its keep-alive
  timer on every byte: one byte every few seconds would keep a connection forever. The body's time is the app's
  (408, as `laya serve`).
- A kept-alive connection waiting for its next request is closed after `idle_timeout`.
- At most `max_connections` connections at once: a request on one more is answered 503 (uvicorn's limit).
- SIGTERM / SIGINT: stop accepting, give in-flight requests `drain_timeout`, close the pool client, exit 0.
- `processes` > 1: that many processes share the bound socket (gateway/processes.py).

The listening socket is bound before the server starts, so a taken port is one line and exit 78 (`EXIT_CONFIG`).
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from laya_pool.protocol import contract
from laya_pool.protocol.listen import family

from . import spin
from .options import GatewayConfig

log = logging.getLogger("laya-pool.gateway")
BACKLOG = 2048


def protocol_class(read_timeout: float) -> type:
    """uvicorn's h11 protocol, without Nagle's delay, closing a connection whose next request head is late."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                # Headers and body go out in two writes: with Nagle's algorithm the second waits for the client's
                # delayed ACK, 40 ms an answer. asyncio sets it only where the socket reports IPPROTO_TCP.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            self.head_timer = self.loop.call_later(read_timeout, self._late)

        def _late(self) -> None:
            self.head_timer = None
            in_request = self.cycle is not None and not self.cycle.response_complete
            if not in_request and not self.transport.is_closing():
                self.transport.close()      # no request head in time: idle, or a head trickling in

    return Protocol


def listen_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(family(host), socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def serve(cfg: GatewayConfig) -> int:
    """Serve until SIGTERM / SIGINT; the exit code. With `cfg.processes` > 1, that many processes share the port
    (gateway/processes.py)."""
    try:
        sock = listen_socket(cfg.host, cfg.port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", cfg.host, cfg.port, e.strerror or e)
        return contract.EXIT_CONFIG
    log.info("the API on http://%s:%d/v1/systemone (pool %s, %s%s)", cfg.host, sock.getsockname()[1], cfg.frontend,
             "bearer key required" if cfg.api_key else "no key: loopback only",
             f", {cfg.processes} processes" if cfg.processes > 1 else "")
    try:
        if cfg.processes == 1:
            return run(cfg, sock)
        from .processes import GatewayProcesses
        return GatewayProcesses(cfg, sock).run()
    finally:
        sock.close()


def run(cfg: GatewayConfig, sock: socket.socket) -> int:
    """One gateway process on the bound `sock` until SIGTERM / SIGINT; the exit code."""
    import uvicorn

    from .app import create_app
    config = uvicorn.Config(create_app(cfg), http=protocol_class(cfg.read_timeout), loop="asyncio", lifespan="on",
                            log_config=None, access_log=False, timeout_keep_alive=cfg.idle_timeout,
                            limit_concurrency=cfg.max_connections, timeout_graceful_shutdown=round(cfg.drain_timeout),
                            backlog=BACKLOG)
    server = uvicorn.Server(config)
    loop = spin.loop_factory(cfg.spin_us / 1e6)()          # asyncio's own loop unless --spin-us
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(server.serve(sockets=[sock]))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()
    return contract.EXIT_OK if server.started else contract.EXIT_CONFIG
