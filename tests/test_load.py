"""`laya-pool load` on a CPU pool: a worker SIGKILLed under load loses nothing; lost requests fail the run."""
import json
import subprocess
import sys
from pathlib import Path

from conftest import SUBPROCESS_ENV

ROOT = Path(__file__).resolve().parents[1]


def _load(tiny_ckpt, tmp_path, *extra):
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "-m", "laya_pool", "load", "--model", str(tiny_ckpt), "--devices", "cpu",
                           "--concurrency", "6", "--procs", "2", "--seconds", "3", "--out", str(out), *extra],
                          cwd=ROOT, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300)
    return proc, json.loads(out.read_text())


def test_killed_worker_loses_nothing(tiny_ckpt, tmp_path):
    proc, rep = _load(tiny_ckpt, tmp_path, "--workers-per-device", "2", "--kill-after", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    clean, kill = rep["pool"], rep["with_kill"]
    assert clean["lost"] == 0 and clean["answered"] > 50 and clean["killed"] is None
    # throughput: the answers within the 3 s window (all client processes began it together, once started), over 3 s
    assert 0 < clean["in_window"] <= clean["answered"] and clean["throughput_rps"] == clean["in_window"] / 3
    assert kill["lost"] == 0 and kill["answered"] > 50
    assert kill["killed"]["killed"] in {"0", "1"} and kill["killed"]["ready_again_s"] > 0
    assert kill["groups"] is None            # a restarted worker counts from 0: no figure rather than a wrong one
    assert "lost 0" in proc.stdout
    # Every answered request went somewhere: straight to a worker, or routed by the broker (a CPU pool: the broker).
    assert clean["paths"]["direct"] + clean["groups"]["broker"]["requests"] >= clean["answered"], clean
    assert "request messages" in proc.stdout
    # Where the CPU went: both workers computed (the CPU pool's forwards), the broker routed, two clients sent.
    used = clean["cpu"]
    roles = [r["role"] for r in used]
    assert roles.count("worker") == 2 and roles.count("client") == 2 and "broker" in roles, used
    assert all(r["cores"] > 0.01 for r in used if r["role"] in ("worker", "client")), used
    # The worker names its threads in the OS, so the busiest ones are told apart (worker/threadname.py).
    assert any(name in ("compute", "io") for r in used if r["role"] == "worker" for name, _ in r["top_threads"]), used
    assert "cpu: " in proc.stdout
    # a CPU worker computes inside its launch: its stamps say nothing of a device, so none is reported
    assert clean["device"] is None and "device (the forwards' stamps)" not in proc.stdout


def test_groups_from_two_snapshots():
    from laya_pool.tools.load import groups
    before = {("0", 11): (10, 2, 6, 1, 2, 0), ("1", 12): (0, 0, 0, 0, 0, 0)}
    after = {("0", 11): (30, 5, 20, 3, 9, 4), ("1", 12): (4, 0, 0, 0, 0, 1)}
    # 24 requests: 3 merged runs of 14 requests, 10 alone: 13 forwards; 2 bundles held 7 of their replies; 5 REQUESTS
    assert groups(before, after) == {"requests": 24, "forwards": 13, "mean_group": 1.85, "bundles": 2, "bundled": 7,
                                     "requests_messages": 5}
    assert groups(before, {("0", 99): (5, 0, 0, 0, 0, 0), ("1", 12): (4, 0, 0, 0, 0, 0)}) is None   # 0 restarted
    # the broker's counts beside the workers': what reached it between the snapshots
    with_broker = groups({**before, "broker": (7, 3)}, {**after, "broker": (19, 5)})
    assert with_broker["broker"] == {"frontend_messages": 12, "requests": 2} and with_broker["requests"] == 24


def test_device_time_from_the_forwards_stamps():
    """Worker a: forwards launched at 0, 1 (queued behind the first), 7 (after a 1 ms idle device) and 9.5 (before the
    third landed at 10); worker b: two forwards, the second after 2 ms idle. Times in ms, stamps in seconds."""
    from laya_pool.tools.load import device_time
    ms = 1e-3
    a = [("a", 0 * ms, 3 * ms, 32), ("a", 1 * ms, 6 * ms, 30), ("a", 7 * ms, 10 * ms, 31), ("a", 9.5 * ms, 13 * ms, 32)]
    b = [("b", 0 * ms, 4 * ms, 8), ("b", 6 * ms, 9 * ms, 8)]
    d = device_time(a + b)
    # a: busy 3 + 3 + 3 ms (the second from 3 ms: the first's landing, not its launch), idle 1 ms, span 3 .. 13
    # b: busy 3, idle 2, span 4 .. 9; the first forward of each worker only opens its span
    assert d == {"forwards": 4, "busy": 0.8, "idle": 0.2, "launched_after_landing": 2, "forward_ms": 3.0}
    assert device_time(a + b + a[1:3]) == d                            # reported by two client processes: once
    assert device_time(a, since=0.5 * ms)["forwards"] == 2            # the first forward launched before `since`
    assert device_time(a[:1]) is None and device_time([]) is None


def test_cpu_use_from_two_snapshots():
    from laya_pool.tools.cpu import role, summary, usage
    before = {1: {"role": "worker", "cpu": 10.0, "threads": {11: 4.0, 12: 6.0}},
              2: {"role": "broker", "cpu": 3.0, "threads": {21: 3.0}},
              3: {"role": "client", "cpu": 1.0, "threads": {31: 1.0}}}
    after = {1: {"role": "worker", "cpu": 12.4, "threads": {11: 5.2, 12: 7.8, 13: 0.0},
                 "names": {11: "io", 12: "compute", 13: "landing"}},
             2: {"role": "broker", "cpu": 4.0, "threads": {21: 4.0}}}           # the client has gone: left out
    rows = usage(before, after, wall=2.0)
    assert [r["pid"] for r in rows] == [1, 2]                                      # busiest first
    assert rows[0]["cores"] == 1.2 and rows[0]["busiest_thread"] == 0.9 and rows[0]["threads"] == 3
    assert rows[0]["top_threads"] == [["compute", 0.9], ["io", 0.6], ["landing", 0.0]]
    assert rows[1]["cores"] == 0.5 and rows[1]["busiest_thread"] == 0.5
    assert summary(rows) == ("cpu: worker 1.20 cores (busiest thread compute 0.90), "
                             "broker 0.50 cores (busiest thread 21 0.50)")             # no name read: its id
    assert role(["python", "-m", "laya_pool.worker.server", "--model", "m"]) == "worker"
    assert role(["python", "-m", "laya_pool.broker.broker"]) == "broker"
    assert role(["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"]) == "client"


def test_lost_requests_fail_the_run(tiny_ckpt, tmp_path):
    # Rows longer than the model's max_len are refused (final): every one of them counts as lost.
    proc, rep = _load(tiny_ckpt, tmp_path, "--tokens", "600")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert rep["pool"]["answered"] == 0 and rep["pool"]["lost"] > 0
    assert "max_len" in rep["pool"]["errors"][0] or "length" in rep["pool"]["errors"][0]


def test_sweep_of_a_mixed_load_writes_json_and_curve(tiny_ckpt, tmp_path):
    png = tmp_path / "sweep.png"
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, "-m", "laya_pool", "load", "--model", str(tiny_ckpt), "--concurrency", "1,3",
                           "--mix", "1x48:3,2x64:1", "--procs", "2", "--seconds", "1.5", "--baseline-args",
                           "--max-batch 1", "--pool-args", "--max-batch 4", "--out", str(out), "--png", str(png)],
                          cwd=ROOT, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    for name in ("baseline", "pool"):
        sweep = rep[name]["sweep"]
        assert [r["concurrency"] for r in sweep] == [1, 3]
        assert rep[name]["concurrency"] == 3 and rep[name]["answered"] == sweep[-1]["answered"]
        for r in sweep:
            assert r["lost"] == 0 and r["answered"] > 5
            assert set(r["per_shape"]) == {"1x48", "2x64"}
            assert sum(s["answered"] for s in r["per_shape"].values()) == r["answered"]
            assert r["per_shape"]["1x48"]["answered"] > r["per_shape"]["2x64"]["answered"]   # weights 3:1
            # what the worker counted in the run's window (a request given up at the end is counted there only)
            g = r["groups"]
            assert r["answered"] <= g["requests"] <= r["answered"] + r["concurrency"], (r["answered"], g)
    assert {r["groups"]["mean_group"] for r in rep["baseline"]["sweep"]} == {1.0}       # --max-batch 1
    assert rep["pool"]["sweep"][-1]["groups"]["mean_group"] >= 1.0
    assert rep["pool"]["pool_args"] == "--max-batch 4" and rep["baseline"]["pool_args"] == "--max-batch 1"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sum(" in flight " in line for line in proc.stdout.splitlines()) == 4   # one line per run


def test_bad_sweep_arguments_are_refused(tiny_ckpt, tmp_path):
    for bad in (["--concurrency", "0,4"], ["--mix", "1x48:0"], ["--mix", "48"]):
        proc = subprocess.run([sys.executable, "-m", "laya_pool", "load", "--model", str(tiny_ckpt), *bad],
                              cwd=ROOT, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "error" in proc.stderr, (bad, proc.stderr)
