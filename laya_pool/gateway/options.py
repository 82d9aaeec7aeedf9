"""The gateway's configuration and its command line (`laya-pool api`; `laya-pool up --api` starts the same command).

Light on purpose: the CLI builds its parser from here on a client install, where FastAPI and uvicorn may be absent.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from laya_pool.protocol import contract, settings
from laya_pool.protocol.listen import is_loopback_host, parse_listen

from .naming import canonical

KEY_ENV, KEY_FILE_ENV = "LAYA_POOL_API_KEY", "LAYA_POOL_API_KEY_FILE"
DEFAULT_LISTEN = "127.0.0.1:8000"


@dataclass
class GatewayConfig:
    frontend: str = contract.FRONTEND
    keys: str | None = None               # CURVE key directory, for a pool that has keys
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None            # bearer token every route but /health's liveness needs
    max_concurrent: int = 128             # requests past auth at once; one more gets 503 (laya serve: 16)
    max_connections: int = 1024           # open connections (and requests) at once; one more gets 503
    read_timeout: float = 10.0            # seconds for a request's head (else the connection closes) and body (408)
    idle_timeout: float = 5.0             # seconds a kept-alive connection may wait for its next request
    timeout: float = 30.0                 # seconds for one HTTP request's pool calls, retries included
    model_name: str = "english"           # the name requests give the pool's checkpoint (gateway/naming.py)
    jev_strict: bool = False              # answer the strict Jev contract (no routing, action, ...)
    root_path: str = ""                   # the public URL prefix behind a reverse proxy
    drain_timeout: float = 5.0            # seconds in-flight requests get to finish after SIGTERM
    processes: int = 1                    # gateway processes sharing the port (gateway/processes.py)
    spin_us: int = 0                      # microseconds the event loop polls after each event (gateway/spin.py)
    http_parser: str = "auto"             # auto (httptools where installed), httptools or h11 (gateway/connection.py)


def add_key_arguments(p: argparse.ArgumentParser) -> None:
    """--api-key and --api-key-file (also `up`'s)."""
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="clients must send `Authorization: Bearer KEY` (a file or the variable keeps it out of the "
                        "process list); needed to listen beyond loopback")
    p.add_argument("--api-key-file", default=None, metavar="FILE", help="read the API key from FILE (one line)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`laya-pool api`'s options (--frontend and --keys are the operator commands' own)."""
    d = GatewayConfig()
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="[HOST:]PORT",
                   help="where to serve HTTP (a bare port: 127.0.0.1); beyond loopback only with an API key")
    add_key_arguments(p)
    p.add_argument("--processes", type=settings.positive(int), default=d.processes,
                   help="gateway processes sharing the port, each with its own pool client and bounds: one answers "
                        "about 2,300 decisions/s on an H100 host (docs/performance.md)")
    p.add_argument("--spin-us", type=int, default=d.spin_us,
                   help="microseconds each process's event loop keeps polling after an event before it sleeps: a "
                        "request in a steady stream finds it awake (0.3 ms less at one client), a core busy while "
                        "requests come (default 0: off; `up --api` sets 2000 for a pool on CUDA)")
    p.add_argument("--http-parser", choices=("auto", "httptools", "h11"), default=d.http_parser,
                   help="the HTTP/1.1 parser: httptools (C, less CPU a request) or h11; auto: httptools where "
                        "installed")
    p.add_argument("--max-concurrent", type=settings.positive(int), default=d.max_concurrent,
                   help="requests past auth at once (bodies buffered, pool calls out); one more is answered 503")
    p.add_argument("--max-connections", type=settings.positive(int), default=d.max_connections,
                   help="open connections at once; a request on one more is answered 503")
    p.add_argument("--read-timeout", type=settings.positive(float), default=d.read_timeout,
                   help="seconds a request's head may take (then the connection is closed) and its body (then 408)")
    p.add_argument("--idle-timeout", type=settings.positive(float), default=d.idle_timeout,
                   help="seconds a kept-alive connection may wait for its next request")
    p.add_argument("--call-timeout", type=settings.positive(float), default=d.timeout,
                   help="seconds one HTTP request's pool calls may take, retries included (then 503)")
    p.add_argument("--model-name", default=d.model_name,
                   help="the name requests give the pool's checkpoint (`model`, `task`, `routing.model`)")
    p.add_argument("--jev-strict", action="store_true",
                   help="answer the strict Jev contract: no routing, action, answer_confidence, x_jev_confidence")
    p.add_argument("--root-path", default="", help="the public URL prefix behind a reverse proxy (default: none)")


def api_key(key: str | None, key_file: str | None) -> str | None:
    """The API key from --api-key / --api-key-file, else $LAYA_POOL_API_KEY / $LAYA_POOL_API_KEY_FILE; ValueError
    for an unreadable file, an empty key, or both given."""
    key = key if key is not None or key_file is not None else settings.raw(KEY_ENV)
    key_file = key_file if key_file is not None or key is not None else settings.raw(KEY_FILE_ENV)
    if key is not None and key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            key = Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file: cannot read {key_file}: {getattr(e, 'strerror', None) or e}") from e
    if key is not None and not key.strip():
        raise ValueError("the API key is empty")
    return None if key is None else key.strip()


def refusal(listen: str, key: str | None, flag: str = "--listen") -> str | None:
    """Why the gateway must not listen on `listen`, or None: beyond loopback it needs an API key."""
    try:
        host, _ = parse_listen(listen, flag)
    except ValueError as e:
        return str(e)
    if not is_loopback_host(host) and not key:
        return (f"refusing to serve the API on {host}: not a loopback address and no API key (--api-key, "
                f"--api-key-file or ${KEY_ENV})")
    return None


def config_from_args(a: argparse.Namespace) -> GatewayConfig:
    """The configuration `laya-pool api`'s arguments give; ValueError names what is wrong."""
    key = api_key(a.api_key, a.api_key_file)
    why = refusal(a.listen, key)
    if why is not None:
        raise ValueError(why)
    host, port = parse_listen(a.listen, "--listen")
    return GatewayConfig(frontend=a.frontend, keys=a.keys, host=host, port=port, api_key=key,
                         max_concurrent=a.max_concurrent, max_connections=a.max_connections,
                         read_timeout=a.read_timeout, idle_timeout=a.idle_timeout, timeout=a.call_timeout,
                         model_name=canonical(a.model_name), jev_strict=a.jev_strict,
                         root_path=a.root_path.rstrip("/"), processes=a.processes,
                         spin_us=max(0, a.spin_us), http_parser=a.http_parser)
