"""`laya-pool up --http`: metrics and health served by a real supervisor over a real CPU pool.

One pool (one tiny CPU worker, short heartbeats) for the module; each test leaves it with its worker ready. The
supervisor polls the broker once a second, so every check waits for the next poll with `wait_until`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import ROOT, SUBPROCESS_ENV, free_port, make_rows, wait_until
from prometheus_client.parser import text_string_to_metric_families

from laya_pool.broker import operator
from laya_pool.client.errors import PoolUnavailable, RequestFailed
from laya_pool.client.local import local_pool
from laya_pool.client.pool import Client

pytestmark = pytest.mark.timeout(180)
OK = ("laya_pool_requests_total", (("outcome", "ok"), ("reason", "")))



def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metrics(port: int) -> dict[tuple[str, tuple], float]:
    code, text = _get(port, "/metrics")
    assert code == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="module")
def pool(tiny_ckpt, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("ops") / "pool.log"
    # A bare port: the supervisor listens on 127.0.0.1 (the URL above would not answer otherwise).
    with local_pool(tiny_ckpt, "cpu", heartbeat_ms=250, liveness=4, log=log, startup_timeout=120,
                    extra_args=["--http", str(port)]) as p:
        p.port = port
        yield p
    assert p.process.returncode == 0, p.log()[-3000:]
    assert "Traceback" not in p.log(), p.log()[-3000:]


def _ready(pool, *, want: int = 200) -> dict:
    def check():
        code, body = _get(pool.port, "/health/ready")
        return json.loads(body) if code == want else None
    # A worker starts in a few seconds; a drain shows at the supervisor's next poll (about 1 s).
    return wait_until(check, 60 if want == 200 else 15,
                      lambda: f"/health/ready never {want}: {_get(pool.port, '/health/ready')}\n{pool.log()[-2000:]}")


def _moved(pool, key: tuple, at_least: float) -> dict:
    return wait_until(lambda: (m := _metrics(pool.port)).get(key, 0) >= at_least and m, 10,
                      lambda: f"{key} stayed at {_metrics(pool.port).get(key)} (< {at_least})")


def test_live_and_ready(pool):
    assert _get(pool.port, "/health/live") == (200, '{"live": true}\n')
    body = _ready(pool)
    assert body["ready"] is True and body["workers"] == {"0": "ready"}
    assert _get(pool.port, "/nope")[0] == 404


def test_predictions_move_the_counters(pool):
    _ready(pool)
    before = _metrics(pool.port)
    rows = make_rows(1, n=3)
    with pool.client(timeout=10) as c:
        for _ in range(4):
            c.forward(rows)
        bad = [(np.array([1, 10**6, 2], np.int32), np.array([1], np.int32), 0)]   # an id beyond the vocabulary
        with pytest.raises(RequestFailed):
            c.forward(bad)
    ok0 = before.get(OK, 0)
    after = _moved(pool, OK, ok0 + 4)
    assert after[OK] == ok0 + 4
    final = ("laya_pool_requests_total", (("outcome", "final"), ("reason", "")))
    assert after.get(final, 0) == before.get(final, 0) + 1
    w0 = (("worker", "0"),)
    tokens = sum(len(r[0]) for r in rows) * 4 + 3
    assert after[("laya_pool_worker_tokens_total", w0)] == before.get(("laya_pool_worker_tokens_total", w0), 0) + tokens
    assert after[("laya_pool_worker_rows_total", w0)] == before.get(("laya_pool_worker_rows_total", w0), 0) + 13
    for h in ("request_seconds", "queue_seconds", "worker_seconds", "compute_seconds"):
        count = f"laya_pool_{h}_count"
        assert after[(count, ())] >= before.get((count, ()), 0) + 4, h
        assert after[(f"laya_pool_{h}_bucket", (("le", "+Inf"),))] == after[(count, ())]
    assert after[("laya_pool_queue_depth", ())] == 0
    assert after[("laya_pool_worker_ready", (("device", "cpu"), ("worker", "0")))] == 1
    assert after[("laya_pool_broker_up", ())] == 1


def test_counters_hold_across_a_broker_restart(pool):
    _ready(pool)
    with pool.client(timeout=10) as c:
        c.forward(make_rows(2, n=1))
    before = _moved(pool, OK, 1)
    old_pid = pool.status()["broker"]["pid"]
    os.kill(old_pid, signal.SIGKILL)        # its counters die with it; the supervisor starts another broker
    wait_until(lambda: pool.status()["broker"]["pid"] != old_pid, 30, "the broker was not restarted",
               ignore=(PoolUnavailable,))
    _ready(pool)
    after = _moved(pool, ("laya_pool_broker_restarts_total", ()), before[("laya_pool_broker_restarts_total", ())] + 1)
    for key, value in before.items():
        if key[0].endswith(("_total", "_bucket", "_count", "_sum")):
            assert after.get(key, 0) >= value, f"{key} went back from {value} to {after.get(key)}"
    with pool.client(timeout=10) as c:
        c.forward(make_rows(3, n=1))
    assert _moved(pool, OK, before[OK] + 1)[OK] == before[OK] + 1   # the new broker's counts add on top


def test_ready_is_503_while_the_only_worker_is_drained(pool):
    _ready(pool)
    restarts = ("laya_pool_worker_restarts_total", (("worker", "0"),))
    before = _metrics(pool.port)
    with Client(pool.endpoint, timeout=10.0, operator=operator.read_secret(pool.endpoint)) as c:   # the operator
        c.drain("0")
        body = _ready(pool, want=503)
        assert body["ready"] is False and body["why"] == "no worker is ready"
        assert body["workers"]["0"] in ("draining", "drained")
        assert _get(pool.port, "/health/live")[0] == 200
        c.drain("0", restart=True)          # restart-worker on a drained worker: the supervisor brings it back
    _ready(pool)
    after = _moved(pool, restarts, before[restarts] + 1)
    assert after[OK] >= before[OK]


def test_http_beyond_loopback_needs_keys(tiny_ckpt):
    out = subprocess.run([sys.executable, "-m", "laya_pool", "up", "--model", str(tiny_ckpt), "--http",
                          f"0.0.0.0:{free_port()}"], cwd=ROOT, env=SUBPROCESS_ENV, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("laya-pool: refusing to serve --http on 0.0.0.0"), out.stderr


def test_a_broker_alone_serves_http_only_where_it_may(tmp_path):
    """`laya-pool broker --http`: beyond loopback without keys it refuses (2) before it binds; a port that is taken
    stops it (78) instead of a broker without metrics."""
    def broker(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "laya_pool", "broker", "--frontend", f"ipc://{tmp_path}/fe",
                               "--backend", f"ipc://{tmp_path}/be", *args], cwd=ROOT, env=SUBPROCESS_ENV,
                              capture_output=True, text=True, timeout=60)
    out = broker("--http", f"0.0.0.0:{free_port()}")
    assert out.returncode == 2 and "refusing to serve --http on 0.0.0.0" in out.stderr, out.stderr
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = broker("--http", str(taken.getsockname()[1]))
    assert out.returncode == 78 and "cannot serve --http" in out.stderr, out.stderr
