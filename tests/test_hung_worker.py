"""A worker whose device hangs keeps heartbeating from its I/O thread; the broker's job deadline catches it."""
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from conftest import SUBPROCESS_ENV, make_rows, stop_all, wait_until

from laya_pool.client.pool import Client

ROOT = Path(__file__).resolve().parents[1]
ENV = SUBPROCESS_ENV


def test_hung_worker_is_declared_dead_and_its_request_runs_elsewhere(tiny_ckpt, tmp_path):
    fe, be = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be"
    procs = [subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend", be,
                               "--heartbeat-ms", "300", "--job-timeout", "3"], env=ENV, cwd=ROOT)]
    worker = [sys.executable, "-m", "laya_pool.worker.server", "--model", str(tiny_ckpt), "--device", "cpu",
              "--backend", be,
              "--heartbeat-ms", "300", "--threads", "1"]
    try:
        procs.append(subprocess.Popen(worker + ["--id", "hangs"], env=dict(ENV, LAYA_WORKER_HANG_ROWS="3"), cwd=ROOT))
        with Client(fe, timeout=60.0, connect_timeout=30.0) as c:
            wait_until(lambda: any(w["id"] == "hangs" and w["state"] == "ready" for w in c.status()["workers"]), 60,
                       "the hanging worker never registered")
            procs.append(subprocess.Popen(worker + ["--id", "healthy"], env=ENV, cwd=ROOT))
            rows = make_rows(0, 3)           # LAYA_WORKER_HANG_ROWS=3
            # Only the hanging worker is up yet: it takes the request and never answers it.
            t0 = time.monotonic()
            res = c.forward(rows)
            took = time.monotonic() - t0
            assert res.worker == "healthy" and len(res.logits) == 3
            assert took >= 2.5, "answered before the deadline: the hanging worker never held it"
            hung = procs[1].wait(30)
            assert hung == 1, "a hung worker must exit with a fatal code for the supervisor to replace it"
            want = c.forward(rows, worker="healthy")
            assert np.array_equal(res.flat, want.flat)
    finally:
        stop_all(procs)
