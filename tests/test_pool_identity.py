"""`laya-pool up` never reports another pool as its own, never takes a running pool's endpoint, and a supervisor
killed with SIGKILL leaves nothing the next start trips over."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import SUBPROCESS_ENV, free_port, make_rows, wait_until

from laya_pool.broker import operator
from laya_pool.client.errors import PoolUnavailable
from laya_pool.client.local import local_pool
from laya_pool.client.pool import Client

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)



def _up(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "laya_pool", "up", *args], env=env or SUBPROCESS_ENV, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_a_second_up_on_a_used_frontend_fails_without_claiming_the_pool(tiny_ckpt, tmp_path):
    fe = f"tcp://127.0.0.1:{free_port()}"
    with local_pool(tiny_ckpt, "cpu", frontend=fe, heartbeat_ms=250, extra_args=["--threads", "1"]) as pool:
        before, secret = pool.status()["broker"]["pid"], operator.read_secret(fe)
        second = _up("--model", str(tiny_ckpt), "--frontend", fe, "--threads", "1", "--heartbeat-ms", "250")
        out, _ = second.communicate(timeout=90)
        assert second.returncode == 78, out
        assert "pool ready" not in out, "the second pool announced the first pool as its own:\n" + out
        assert "in use" in out or "cannot bind" in out, out
        st = pool.status()
        assert st["broker"]["pid"] == before and operator.read_secret(fe) == secret
        with pool.client(timeout=10.0) as c:
            assert len(c.forward(make_rows(0, 2)).logits) == 2
    # ipc: ZeroMQ would unlink a live socket file and bind over it; the broker refuses instead.
    fe = f"ipc://{tmp_path}/fe"
    first = subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend",
                              f"ipc://{tmp_path}/be"], env=SUBPROCESS_ENV, cwd=ROOT)
    try:
        with Client(fe, timeout=30.0, connect_timeout=30.0) as c:   # waits for the broker to bind
            pid = c.status()["broker"]["pid"]
            r = subprocess.run([sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend",
                                f"ipc://{tmp_path}/be2"], env=SUBPROCESS_ENV, cwd=ROOT, capture_output=True,
                               text=True, timeout=60)
            assert r.returncode == 78 and "in use by another running process" in r.stderr, r.stderr
            assert c.status()["broker"]["pid"] == pid, "the first broker must keep its endpoint"
    finally:
        first.terminate()
        first.wait(20)


def test_a_supervisor_killed_with_sigkill_leaves_nothing_the_next_start_trips_over(tiny_ckpt, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = dict(SUBPROCESS_ENV, TMPDIR=str(tmpdir))
    fe = f"ipc://{tmp_path}/fe"
    args = ("--model", str(tiny_ckpt), "--frontend", fe, "--threads", "1", "--heartbeat-ms", "250")
    first = _up(*args, env=env)
    try:
        with Client(fe, timeout=2.0, retries=0) as c:
            st = wait_until(lambda: c.status(), 90, "the first pool never answered", ignore=(PoolUnavailable,))
            children = [psutil.Process(st["broker"]["pid"])]
            wait_until(lambda: any(w["state"] == "ready" for w in c.status()["workers"]), 90, "no worker",
                       ignore=(PoolUnavailable,))
            children += [psutil.Process(w["pid"]) for w in c.status()["workers"]]
        left = list(tmpdir.glob("laya-pool-*"))
        assert len(left) == 1
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        psutil.wait_procs(children, timeout=30)
        assert not any(p.is_running() for p in children), "children must not outlive a killed supervisor"
        assert left[0].exists(), "SIGKILL gives the supervisor no chance to clean up (this is what we repair)"
        second = _up(*args, env=env)
        try:
            with Client(fe, timeout=2.0, retries=0) as c:
                t = time.monotonic()
                wait_until(lambda: any(w["state"] == "ready" for w in c.status()["workers"]), 90,
                           "the second pool never became ready", ignore=(PoolUnavailable,))
                print(f"second pool ready {time.monotonic() - t:.1f} s after start")
                assert len(c.forward(make_rows(1, 1)).logits) == 1
            assert not left[0].exists(), "the next start must remove what the killed supervisor left"
        finally:
            second.send_signal(signal.SIGTERM)
            out, _ = second.communicate(timeout=60)
        assert second.returncode == 0, out
        assert not list(tmpdir.glob("laya-pool-*")), "a clean stop leaves nothing behind"
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGKILL)
