#!/usr/bin/env python3
"""How fast this host runs the pool's host-side steps, hot and right after a wait: the device hosts' numbers beside
the development CPU's, to find why their Python work is 3-7x slower (docs/PERF.md, "Why the device hosts' host work
is slow").

    python3 scripts/probe_host.py [--model DIR] [--json FILE] [--quick]

The H200 host ran a client's encode of a 1x48 request in 0.168 ms against 0.030 on the 2-core development CPU, and
its decode (numpy and Python, no tokenizer) in 0.111 against 0.016; at saturation the worker's data thread took ~115
us a request against ~37 here. A hot loop on a server core should not be 5-7x slower than a desktop core, so this
asks three questions of a host, each with a number:

1. the machine: CPU model, cores, frequency governor, cgroup CPU quota, the Python build;
2. the steps *hot* (back to back, in a loop): a pure-Python loop, small numpy calls, msgpack, the tokenizer (one
   short and one long text; in a child with TOKENIZERS_PARALLELISM=false and one with RAYON_NUM_THREADS=1 too: a
   one-text batch may still wake a thread pool sized to the host);
3. the same steps *after a wait* (a 1 ms sleep before each, as a caller's thread sleeps through a forward): what a
   core's idle state and frequency cost the first microseconds after it wakes; and how long a thread takes to wake
   another (`threading.Event`, what the landing watch does) and a ZeroMQ round trip between two threads.

Prints one table (p50 us) and writes --json. Needs numpy, msgpack and pyzmq; the tokenizer rows need --model (a
checkpoint directory: its tokenizer).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

# The checkout root, for laya_pool where it is not installed.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHORT = ("ticket customer refund invoice urgent billing account password reset login error timeout "
         "shipping delay")
HEADER = {"rid": 123456, "status": "ok", "markers": 4, "rows": 1, "n_act": 2, "worker": "w0", "fp": "5" * 64,
          "metrics": {"mode": "graph-cached", "shape": [1, 48, 4], "first_call": False, "validate_ms": 0.01,
                      "plan_ms": 0.02, "pack_ms": 0.05, "device_ms": 1.0, "total_ms": 1.1, "batched": 1,
                      "queue_ms": 0.1, "worker_ms": 1.2, "received_at": 1.0, "started_at": 1.0, "launched_at": 1.0,
                      "landed_at": 1.0, "done_at": 1.0}}


def machine() -> dict[str, Any]:
    """What the numbers depend on, read without privileges (missing files give None)."""
    def read(path: str) -> str | None:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None

    model = None
    for line in (read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    freqs = []
    for cpu in range(os.cpu_count() or 1):
        f = read(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq")
        if f is not None:
            freqs.append(int(f) // 1000)
    return {"cpu": model, "cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "governor": read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
            "mhz_now": [min(freqs), statistics.median(freqs), max(freqs)] if freqs else None,
            "cgroup_cpu_max": read("/sys/fs/cgroup/cpu.max"), "python": sys.version.split()[0],
            "python_impl": platform.python_implementation(),
            "python_config": (sysconfig.get_config_var("CONFIG_ARGS") or "")[:300],
            "numpy": np.__version__, "load": os.getloadavg()}


def timed(step: Callable[[], Any], n: int, wait_s: float = 0.0) -> float:
    """p50 microseconds of `step`; with `wait_s`, a sleep before each call (not timed)."""
    for _ in range(min(n, 200)):
        step()
    ts = []
    pc = time.perf_counter
    for _ in range(n):
        if wait_s:
            time.sleep(wait_s)
        a = pc()
        step()
        ts.append(pc() - a)
    return statistics.median(ts) * 1e6


def steps() -> dict[str, Callable[[], Any]]:
    """Host steps of the size a 1x48 request's take (no pool code: any host can run them)."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(5, 1000, 48).astype(np.int32) for _ in range(4)]
    logits = rng.standard_normal(4).astype(np.float32)
    packed = msgpack.packb(HEADER)
    data = {f"k{i}": i for i in range(64)}

    def python_loop() -> int:        # ~ what a step of the data thread does: attribute and dict work, no C calls
        s = 0
        for k, v in data.items():
            if v & 1:
                s += len(k)
        return s

    def numpy_small() -> Any:        # ~ Batch.from_rows + a softmax: a dozen small numpy calls
        a = np.concatenate(ids)
        b = np.array([len(x) for x in ids], np.int32)
        z = logits / 1.5
        p = np.exp(z - z.max())
        p /= p.sum()
        return a.sum() + b.max() + float(p.max())

    return {"python loop (64 dict items)": python_loop, "numpy small (~12 calls)": numpy_small,
            "msgpack pack reply header": lambda: msgpack.packb(HEADER),
            "msgpack unpack reply header": lambda: msgpack.unpackb(packed)}


def tokenizer_steps(model: str) -> dict[str, Callable[[], Any]]:
    from laya_pool.client.card import ModelCard

    tok = ModelCard.from_dir(model).tokenizer
    long = " ".join([SHORT] * 140)          # ~15 KB, the 16x512 request's state
    return {"tokenizer encode_batch_fast, 100 chars": lambda: tok.encode_batch_fast([SHORT], add_special_tokens=False),
            "tokenizer encode, 100 chars": lambda: tok.encode(SHORT, add_special_tokens=False),
            "tokenizer encode_batch_fast, 15 KB": lambda: tok.encode_batch_fast([long], add_special_tokens=False)}


def thread_wake(n: int) -> float:
    """p50 us from one thread's `Event.set` to the waiting thread running (the landing watch's hand-off)."""
    go, back = threading.Event(), threading.Event()
    stamp = [0.0]
    ts: list[float] = []

    def waiter() -> None:
        for _ in range(n):
            go.wait()
            go.clear()
            ts.append(time.perf_counter() - stamp[0])
            back.set()

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    for _ in range(n):
        time.sleep(0.0005)
        stamp[0] = time.perf_counter()
        go.set()
        back.wait()
        back.clear()
    t.join()
    return statistics.median(ts[n // 10:]) * 1e6


def zmq_round_trip(n: int, transport: str) -> float:
    """p50 us of a request and its reply between two threads over ZeroMQ (a DEALER and a ROUTER), as small as a
    1x48 request's."""
    import zmq

    ctx = zmq.Context()
    srv = ctx.socket(zmq.ROUTER)
    endpoint = "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc:///tmp/probe-host-{os.getpid()}"
    srv.bind(endpoint)
    endpoint = srv.getsockopt_string(zmq.LAST_ENDPOINT)
    cli = ctx.socket(zmq.DEALER)
    cli.connect(endpoint)

    def echo() -> None:
        for _ in range(n + 50):
            srv.send_multipart(srv.recv_multipart())

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    ts = []
    for i in range(n + 50):
        a = time.perf_counter()
        cli.send_multipart([b"x" * 120, b"y" * 220])
        cli.recv_multipart()
        if i >= 50:
            ts.append(time.perf_counter() - a)
    t.join()
    cli.close(0)
    srv.close(0)
    ctx.term()
    return statistics.median(ts) * 1e6


def run_all(model: str | None, n: int) -> dict[str, Any]:
    rows: dict[str, dict[str, float]] = {}
    all_steps = steps()
    if model:
        all_steps.update(tokenizer_steps(model))
    for name, step in all_steps.items():
        rows[name] = {"hot": timed(step, n), "after 1 ms sleep": timed(step, max(200, n // 10), 0.001)}
    rows["thread wake (Event.set -> waiter runs)"] = {"hot": thread_wake(max(200, n // 10))}
    for transport in ("ipc", "tcp"):
        rows[f"zmq round trip, two threads, {transport}"] = {"hot": zmq_round_trip(max(500, n // 4), transport)}
    return rows


def tokenizer_children(model: str, n: int) -> dict[str, dict[str, float]]:
    """The tokenizer rows again in children with the thread pools held to one thread."""
    out = {}
    for env in ({"TOKENIZERS_PARALLELISM": "false"}, {"RAYON_NUM_THREADS": "1"}):
        code = (f"import json, sys; sys.argv = ['x']; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import probe_host as p; "
                f"print(json.dumps({{k: p.timed(s, {n}) for k, s in p.tokenizer_steps({model!r}).items()}}))")
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                           timeout=300)
        tag = ",".join(f"{k}={v}" for k, v in env.items())
        out[tag] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-300:]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a checkpoint directory (its tokenizer); without it no tokenizer rows")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    a = ap.parse_args(argv)
    n = 300 if a.quick else 5000
    result = {"machine": machine(), "steps": run_all(a.model, n)}
    if a.model:
        result["tokenizer, one thread"] = tokenizer_children(a.model, max(200, n // 5))
    print(json.dumps(result["machine"]))
    print(f"{'step':48s} {'hot us':>9s} {'after 1 ms sleep':>17s}")
    for name, r in result["steps"].items():
        after = r.get("after 1 ms sleep")
        print(f"{name:48s} {r['hot']:9.2f} {'' if after is None else f'{after:17.2f}'}")
    for tag, r in result.get("tokenizer, one thread", {}).items():
        for name, v in r.items():
            print(f"{name + ' [' + tag + ']':64s} {v if isinstance(v, str) else f'{v:9.2f}'}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
