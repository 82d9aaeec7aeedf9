"""The operations HTTP endpoint (`--http [HOST:]PORT` of `laya-pool up`, `broker` and `workers`): /metrics,
/health/live, /health/ready.

The I/O half of the operations surface: what to say comes from an observer (a pool's: broker/observe.py; a worker
host's: broker/host.py). Served from a daemon thread of the supervisor (or broker) process (http.server; a scrape
every few seconds needs nothing more), so it answers while the supervisor runs, also while the broker is down or
restarting: then /health/ready says so.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from laya_pool.protocol.listen import family as _family
from laya_pool.protocol.listen import is_loopback_host, parse_listen

from .observe import Observer

log = logging.getLogger("laya-pool.http")


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


class MetricsServer:
    """Binds at construction (so a taken port fails `laya-pool up` at once); serves from a daemon thread."""

    def __init__(self, listen: str, observer: Observer):
        host, port = parse_listen(listen)
        self.observer = observer
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(observer))
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                server._handle(self)

            def log_message(self, format: str, *args: Any) -> None:   # noqa: A002 - scrapes are not news
                log.debug("%s " + format, self.address_string(), *args)

        # A subclass per server: the address family is a class attribute of http.server's servers.
        server_class = type("_Server", (ThreadingHTTPServer,), {"address_family": _family(host),
                                                                 "daemon_threads": True})
        self.httpd = server_class((host, port), Handler)
        self.address = self.httpd.server_address[:2]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="laya-pool-http", daemon=True)
        self.thread.start()
        log.info("metrics and health on http://%s:%d (/metrics, /health/live, /health/ready)", host, self.address[1])

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        path = req.path.split("?", 1)[0]
        if path == "/metrics":
            _reply(req, 200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
        elif path == "/health/live":
            _reply_json(req, 200, {"live": True})
        elif path == "/health/ready":
            ready, body = self.observer.readiness(time.monotonic())
            _reply_json(req, 200 if ready else 503, body)
        else:
            _reply_json(req, 404, {"error": "not found", "paths": ["/metrics", "/health/live", "/health/ready"]})

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _reply(req: BaseHTTPRequestHandler, code: int, body: bytes, content_type: str) -> None:
    req.send_response(code)
    req.send_header("Content-Type", content_type)
    req.send_header("Content-Length", str(len(body)))
    req.end_headers()
    req.wfile.write(body)


def _reply_json(req: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
    _reply(req, code, (json.dumps(body, sort_keys=True) + "\n").encode(), "application/json")
