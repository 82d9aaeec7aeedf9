"""A broker out of file descriptors says so once, in words an operator can act on, and keeps serving.

The broker runs under a small open-files limit (RLIMIT_NOFILE); plain TCP connections to its frontend use up
what is left, so its accepts fail with EMFILE. Its log must carry one line naming the cause and the fix (and
not one per refused connection), and once the connections close, a client is served as before.
"""
from __future__ import annotations

import resource
import socket
import subprocess
import sys

import pytest
from conftest import ROOT, SUBPROCESS_ENV, free_port, wait_until

from laya_pool.client.pool import Client

pytestmark = pytest.mark.timeout(60)
FD_LIMIT = 64          # enough for the broker's own sockets and pipes, not for 100 more connections
LINE = "could not accept a connection (out of file descriptors"



def test_fd_exhaustion_logs_one_clear_line_and_the_broker_recovers(tmp_path):
    fe, be = f"tcp://127.0.0.1:{free_port()}", f"ipc://{tmp_path}/be"
    log = tmp_path / "broker.log"
    with open(log, "w") as out:
        broker = subprocess.Popen(
            [sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend", be],
            env=SUBPROCESS_ENV, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT)))
    conns: list[socket.socket] = []
    try:
        with Client(fe, timeout=30.0, connect_timeout=30.0) as c:   # waits for the broker to bind
            c.ping()                                      # up and serving
        port = int(fe.rsplit(":", 1)[1])
        for _ in range(100):
            conns.append(socket.create_connection(("127.0.0.1", port)))
        wait_until(lambda: LINE in log.read_text(), 10, lambda: f"no fd line in the log:\n{log.read_text()[-2000:]}")
        assert "ulimit -n" in log.read_text(), "the line must say what to fix"
        for s in conns:
            s.close()
        conns.clear()
        with Client(fe, timeout=5.0, retries=3) as c:
            assert c.ping() > 0                            # the broker kept its loop and serves again
        assert log.read_text().count(LINE) == 1, "one line per interval, not one per refused connection"
        assert broker.poll() is None
    finally:
        for s in conns:
            s.close()
        broker.terminate()
        broker.wait(20)
