"""What several devices need, checked where no second GPU exists (the rest needs a host with two GPUs).

- the supervisor gives each GPU worker its own GPU (CUDA_VISIBLE_DEVICES) and the worker maps it back;
- a worker started apart, on another "host", joins a broker over TCP and serves;
- (several workers on one device: tests/test_pool.py and the demo).
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import SUBPROCESS_ENV, free_port, make_rows, stop_all, wait_until

from laya_pool.broker.supervisor import Supervisor, SupervisorConfig
from laya_pool.worker.placement import cuda_local_device as _cuda_local_device

ROOT = Path(__file__).resolve().parents[1]
ENV = SUBPROCESS_ENV


def test_supervisor_puts_one_worker_on_each_gpu(tiny_ckpt):
    sup = Supervisor(SupervisorConfig(model=str(tiny_ckpt), devices=["cuda:0", "cuda:1", "cpu"], workers_per_device=2))
    seen = {}
    for wid, child in sup.workers.items():
        device = child.argv[child.argv.index("--device") + 1]
        seen[wid] = (device, child.env.get("CUDA_VISIBLE_DEVICES"), "--cpus" in child.argv)
    assert seen == {"0": ("cuda:0", "0", False), "1": ("cuda:0", "0", False), "2": ("cuda:1", "1", False),
                    "3": ("cuda:1", "1", False), "4": ("cpu", None, True), "5": ("cpu", None, True)}
    cpu_sets = [c.argv[c.argv.index("--cpus") + 1] for c in sup.workers.values() if "--cpus" in c.argv]
    if len(os.sched_getaffinity(0)) >= 2:
        assert len(set(cpu_sets)) == 2, "CPU workers get disjoint cores"


def test_worker_maps_its_one_visible_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert _cuda_local_device("cuda:1") == ("cuda:0", "cuda:1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert _cuda_local_device("cuda:3") == ("cuda:1", "cuda:3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _cuda_local_device("cuda:1") == ("cuda:1", "cuda:1")



def test_remote_style_workers_join_over_tcp_and_agree(tiny_ckpt):
    from laya_pool.client.errors import PoolError
    from laya_pool.client.pool import Client
    fe, be = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend", be,
                               "--heartbeat-ms", "300", "--insecure-backend"], env=ENV, cwd=ROOT)]
    try:
        for wid in ("hostA-0", "hostB-0"):
            procs.append(subprocess.Popen([sys.executable, "-m", "laya_pool.worker.server", "--model", str(tiny_ckpt),
                                           "--device", "cpu", "--backend", be, "--id", wid, "--threads", "1",
                                           "--heartbeat-ms", "300"], env=ENV, cwd=ROOT))
        with Client(fe, timeout=5.0, retries=2) as c:
            wait_until(lambda: sum(w["state"] == "ready" for w in c.status()["workers"]) == 2, 120,
                       "workers did not join over tcp", interval=0.3, ignore=(PoolError,))
            rows = make_rows(1, 1, length=55, markers=3)
            served = {c.forward(rows, worker=w).worker for w in ("hostA-0", "hostB-0")}
            a, b = (c.forward(rows, worker=w) for w in ("hostA-0", "hostB-0"))
            assert served == {"hostA-0", "hostB-0"}
            assert np.array_equal(a.flat, b.flat) and np.array_equal(a.act, b.act)
    finally:
        stop_all(procs)
