"""A hung device (the compute thread stuck, the I/O thread still heartbeating) is found within seconds by the
worker's own watchdog (--compute-timeout), not after the broker's --job-timeout (300 s): the worker leaves
("fatal"), the request it ran and the one queued behind it go to a healthy worker, and a pool with a hung
worker stops within 10 s."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import SUBPROCESS_ENV, make_rows, stop_all, wait_until

from laya_pool.client.errors import PoolError
from laya_pool.client.local import local_pool
from laya_pool.client.pool import Client

ROOT = Path(__file__).resolve().parents[1]
ENV = SUBPROCESS_ENV
pytestmark = pytest.mark.timeout(180)
WATCHDOG_S = 2.0


def test_the_watchdog_finds_a_hung_device_and_its_requests_run_elsewhere(tiny_ckpt, tmp_path):
    fe, be = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be"
    # The broker's job deadline stays at its default (300 s): only the worker's watchdog can be quick here.
    procs = [subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend", be,
                               "--heartbeat-ms", "300"], env=ENV, cwd=ROOT)]
    worker = [sys.executable, "-m", "laya_pool.worker.server", "--model", str(tiny_ckpt), "--device", "cpu",
              "--backend", be,
              "--heartbeat-ms", "300", "--threads", "1", "--compute-timeout", str(WATCHDOG_S)]
    try:
        procs.append(subprocess.Popen(worker + ["--id", "hangs"], env=dict(ENV, LAYA_WORKER_HANG_ROWS="3"), cwd=ROOT))
        with Client(fe, timeout=30.0) as c:
            wait_until(lambda: any(w["id"] == "hangs" and w["state"] == "ready" for w in c.status()["workers"]), 60,
                       "the hanging worker never registered")
            results: dict[str, object] = {}

            def ask(name: str, rows) -> None:
                with Client(fe, timeout=30.0) as own:
                    t = time.monotonic()
                    res = own.forward(rows)
                    results[name] = (res.worker, len(res.logits), time.monotonic() - t)

            # Only the hanging worker is up: it takes both (credit 2), hangs on the first, holds the second.
            threads = [threading.Thread(target=ask, args=("stuck", make_rows(0, 3)))]
            threads[0].start()
            time.sleep(0.3)
            threads.append(threading.Thread(target=ask, args=("queued", make_rows(1, 1))))
            threads[1].start()
            wait_until(lambda: sum(w["inflight"] for w in c.status()["workers"]) == 2, 10, "both must be held")
            procs.append(subprocess.Popen(worker + ["--id", "healthy"], env=ENV, cwd=ROOT))
            assert procs[1].wait(30) == 1, "a hung worker exits with the fatal code (the supervisor restarts it)"
            for t in threads:
                t.join(60)
            assert results["stuck"][:2] == ("healthy", 3) and results["queued"][:2] == ("healthy", 1), results
            took = max(r[2] for r in results.values())
            print(f"both requests answered by the healthy worker {took:.1f} s after they were sent")
            assert took < 15, f"took {took:.1f} s"
            rows = {w["id"]: w["state"] for w in c.status()["workers"]}
            assert rows["hangs"] != "ready" and rows["healthy"] == "ready", rows
    finally:
        stop_all(procs)


def test_a_pool_with_a_hung_worker_stops_within_10_s(tiny_ckpt):
    # The CPU watchdog is left at its default (30 s): only the supervisor's bounded drain can make this quick.
    failed: list[tuple[str, float]] = []
    with local_pool(tiny_ckpt, "cpu", heartbeat_ms=250, env={"LAYA_WORKER_HANG_ROWS": "3"},
                    extra_args=["--threads", "1"]) as pool:
        def hang() -> None:
            try:
                with Client(pool.endpoint, timeout=30.0, retries=0) as c:
                    c.forward(make_rows(0, 3))
            except PoolError as e:
                failed.append((str(e), time.monotonic()))
        threading.Thread(target=hang, daemon=True).start()
        wait_until(lambda: pool.status()["broker"]["inflight"] == 1, 10, "the worker must hold the request")
        t = time.monotonic()
        code = pool.stop(timeout=20)
        took = time.monotonic() - t
        log = pool.log()
    print(f"stopped in {took:.1f} s (exit {code}); the held request failed {failed[0][1] - t:.1f} s after the "
          f"SIGTERM: {failed[0][0]}" if failed else f"stopped in {took:.1f} s (exit {code})")
    assert took <= 10 and code == 0, f"stopping took {took:.1f} s, exit {code}:\n{log[-3000:]}"
    assert "did not leave within 5 s of being told to stop; killing it (SIGKILL)" in log, log[-3000:]
    # What the killed worker held is failed by the stopping broker as retryable (this caller has no retries left).
    wait_until(lambda: failed, 5, "the held request must fail when the pool stops")
    assert "shutting down" in failed[0][0], failed
