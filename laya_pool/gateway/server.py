"""The gateway process: the app (gateway/app.py) served by uvicorn on one asyncio event loop (no thread per
connection), with the bounds `laya serve` leaves to its deployment.

- Each connection's bounds (gateway/connection.py): a request head within `read_timeout` and 16 KiB, TCP_NODELAY;
  httptools parses where it is installed, else h11. The body's time is the app's (408, as `laya serve`).
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

from laya_pool.protocol import contract
from laya_pool.protocol.listen import family

from . import spin
from .connection import bounded_heads, protocol_class
from .options import GatewayConfig

log = logging.getLogger("laya-pool.gateway")
BACKLOG = 2048


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
    from .routes import in_front
    http = protocol_class(cfg.read_timeout, cfg.http_parser)
    app = bounded_heads(in_front(create_app(cfg)))
    config = uvicorn.Config(app, http=http, loop="asyncio", lifespan="on", log_config=None, access_log=False,
                            timeout_keep_alive=cfg.idle_timeout, limit_concurrency=cfg.max_connections,
                            timeout_graceful_shutdown=round(cfg.drain_timeout), backlog=BACKLOG)
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
