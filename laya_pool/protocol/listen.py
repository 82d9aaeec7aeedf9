"""HTTP listen addresses (`--http`, `--api`, `--listen`): `[HOST:]PORT`, and whether a host is loopback.

Here, in the protocol package, because the supervisor's metrics endpoint (broker/ops_http.py) and the HTTP gateway
(gateway/) both take one, and both refuse an address beyond loopback without a credential.
"""
from __future__ import annotations

import ipaddress
import socket


def parse_listen(value: str, flag: str = "--http") -> tuple[str, int]:
    """`PORT`, `:PORT`, `HOST:PORT` or `[V6]:PORT` -> (host, port); a bare port listens on 127.0.0.1."""
    value = value.strip()
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "", value
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} {value!r}: expected PORT or HOST:PORT")
    return host, int(port)


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost; a host name may resolve to anything, so it counts as exposed."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def family(host: str) -> int:
    """The socket family that binds `host`."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET
