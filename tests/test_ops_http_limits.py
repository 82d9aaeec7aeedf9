"""What a local peer can cost the `--http` endpoint (issue #54): real sockets against the real `MetricsServer`.

The server runs in this process (a supervisor's thread, with an observer of no pool), so its threads and its log
can be counted; tests/test_supervisor_faults.py holds the same bounds with a real pool.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from conftest import free_port, wait_until

from laya_pool.broker import ops_http
from laya_pool.broker.observe import PoolObserver

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    s = ops_http.MetricsServer(str(free_port()), PoolObserver(lambda: {"stopping": False}))
    yield s
    s.close()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _get(port: int, path: str) -> tuple[int, bytes]:
    with _connect(port) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _closed_by_server(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_idle_connections_are_bounded_closed_within_seconds_and_take_no_thread(server):
    port = server.address[1]
    threads = threading.active_count()
    idle = [_connect(port) for _ in range(600)]
    try:
        t = time.perf_counter()
        assert _get(port, "/health/live") == (200, b'{"live": true}\n')
        live_s = time.perf_counter() - t
        assert threading.active_count() <= threads, "a thread per connection"
        # Beyond the bound the oldest idle ones were closed to make room; the newest wait for their deadline.
        shut = wait_until(lambda: (n := sum(map(_closed_by_server, idle))) >= len(idle) - ops_http.MAX_CONNECTIONS
                          and n, 5, "the server kept more than its bound of idle connections open")
        t0 = time.monotonic()
        wait_until(lambda: all(map(_closed_by_server, idle)), ops_http.REQUEST_S + 2,
                   "idle connections outlived the request deadline")
        print(f"600 idle: /health/live in {live_s * 1e3:.1f} ms, {shut} closed at once to stay within "
              f"{ops_http.MAX_CONNECTIONS}, the rest {time.monotonic() - t0:.1f} s later")
        assert live_s < 1.0
    finally:
        for s in idle:
            s.close()


def test_a_slow_request_is_closed_within_seconds(server):
    port = server.address[1]
    with _connect(port) as s:
        t0 = time.monotonic()
        closed = None
        for ch in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":       # never the blank line that ends it
            try:
                s.sendall(bytes([ch]))
            except OSError:
                closed = time.monotonic() - t0
                break
            if _closed_by_server(s):
                closed = time.monotonic() - t0
                break
            s.setblocking(True)
            time.sleep(0.1)
        assert closed is not None and closed <= ops_http.REQUEST_S + 2 * ops_http.TICK_S, closed


def test_a_request_larger_than_the_bound_is_refused(server):
    with _connect(server.address[1]) as s:
        s.sendall(b"GET / HTTP/1.1\r\n" + b"X-Fill: " + b"a" * (2 * ops_http.MAX_REQUEST_BYTES))
        assert s.recv(100).startswith(b"HTTP/1.1 431 ")


def test_aborted_and_malformed_requests_cost_one_line_a_second_per_cause(server, caplog, capfd):
    port = server.address[1]
    caplog.set_level(logging.DEBUG, logger="laya-pool.http")
    t0 = time.monotonic()
    for i in range(300):
        with _connect(port) as s:
            if i % 3 == 0:
                s.sendall(b"NONSENSE\r\n\r\n")                        # malformed
                s.recv(100)
            elif i % 3 == 1:
                s.sendall(b"GET /metrics HTT")                       # aborted mid-request
            else:
                s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")           # aborted before reading the reply
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    assert _get(port, "/health/live")[0] == 200
    time.sleep(2 * ops_http.TICK_S + 1.0)                             # the held-back counts are said
    elapsed = time.monotonic() - t0
    records = [r for r in caplog.records if r.name == "laya-pool.http"]
    text = [r.getMessage() for r in records]
    err = capfd.readouterr().err
    print(f"\n300 bad requests in {elapsed:.1f} s: {len(records)} log lines")
    assert all("\n" not in m and r.exc_info is None for r, m in zip(records, text)), text
    assert "Traceback" not in err
    per_cause = 2 * (elapsed + 2)            # one a second per cause, and the count said once it went quiet
    assert len(records) <= 3 * per_cause, text
    assert any("more like" in m for m in text), text
