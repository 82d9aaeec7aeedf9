"""How far one broker goes: 8 hosts of 8 workers (stub workers) over tcp + CURVE, on one machine.

    python -m benchmarks.scale [--hosts 8] [--workers 8] [--procs 2] [--window 64] [--seconds 5]
                               [--phases idle,routed,direct,routes] [--out DIR]

Starts a broker (`python -m laya_pool.broker.broker`, tcp frontend and backend on 127.0.0.1, keys) and --hosts
processes of --workers stub workers each (laya_pool/tools/stub_worker.py: they answer at once, without a model), each
"host" on a loopback address of its own (127.0.0.11, .12, ...) where its workers' direct sockets listen (CURVE). Then
one phase after the other:

- `idle`: no traffic: the broker's CPU for the workers' heartbeats (the control plane's floor);
- `routed`: --procs load processes, each one DEALER (the client keys) on the frontend keeping --window 1x48 requests in
  flight: every call through the broker (4 broker messages a call);
- `direct`: the same load, each process with a DEALER to every worker's direct socket (from the broker's table of
  routes, each authenticated by its worker's key), the requests spread over them: the broker only gave the table;
- `routes`: load processes asking for that table (a ping with routes=True), --window in flight: what a client's
  refresh costs the broker (each client asks every 5 s, client/direct.py REFRESH_S).

For each: calls/s; the CPU each part used over the timed span (/proc: the broker with its I/O and ZAP threads, the
stub hosts, the load processes), in cores; and the broker's CPU per call. What saturates first is the part at a whole
core (the broker's loop is one thread) or the machine when all parts together use its cores: on a machine with few
cores every part competes for them, so the rates are this machine's, and the broker's CPU per call is the figure that
carries to another host (one core of it is the broker's ceiling).
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import cpu_seconds, parser, write

PHASES = ("idle", "routed", "direct", "routes")
BROKER_MESSAGES = {"routed": 4, "direct": 0, "routes": 2}
WARMUP_S = 1.0


def _sockets(ctx: Any, kind: str, frontend: str, keys: str, routes: list) -> list:
    """The load process's DEALERs: one on the frontend, or one to each worker's direct socket."""
    import zmq

    from laya_pool.protocol import wire
    out = []
    targets = [(r[1], r[3]) for r in routes] if kind == "direct" else [(frontend, None)]
    for endpoint, key in targets:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        wire.configure_curve_client(s, keys, "client", server_key=key.encode() if key else None)
        s.connect(endpoint)
        out.append(s)
    return out


def _load(kind: str, frontend: str, keys: str, routes: list, window: int, seconds: float, out: Any) -> None:
    """One load process: `window` calls in flight over its sockets (a reply's socket gets the next call); the ok
    replies inside the timed span are counted."""
    import uuid

    import numpy as np
    import zmq

    from laya_pool.protocol import wire
    from laya_pool.protocol.wire import Cmd

    ctx = zmq.Context()
    socks = _sockets(ctx, kind, frontend, keys, routes)
    cid, rid = uuid.uuid4().hex, 0
    rng = np.random.default_rng(0)
    arrays = wire.pack_rows([(rng.integers(10, 1000, 48).astype(np.int32), np.array([5, 8, 11, 14], np.int32), 0)])

    def send(s: Any) -> None:
        nonlocal rid
        rid += 1
        frames = (wire.encode(Cmd.HEARTBEAT, {"rid": rid, "routes": True}) if kind == "routes"
                  else wire.encode_request(rid, arrays, cid=cid))
        s.send_multipart(frames, copy=False)

    for i in range(window):
        send(socks[i % len(socks)])
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    t0 = time.monotonic() + WARMUP_S
    t1 = t0 + seconds
    counted = errors = 0
    ok_status = b"\xa6status\xa2ok"          # the msgpack of "status": "ok": no full decode per reply
    while time.monotonic() < t1:
        ready = dict(poller.poll(2000))
        if not ready:
            break                               # nothing answers any more: report what was counted
        for s in ready:
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if t0 <= time.monotonic() < t1:
                    ok = ok_status in frames[0]
                    counted += ok
                    errors += not ok
                send(s)
    out.put({"calls": counted, "errors": errors})
    end = time.monotonic() + 1.0           # the calls still out are read, so the broker drops no reply of ours
    while time.monotonic() < end and poller.poll(100):
        for s in socks:
            with contextlib.suppress(zmq.Again):
                while True:
                    s.recv_multipart(zmq.NOBLOCK)
    ctx.destroy(linger=0)


def _cores(pids: list[int], before: dict[int, float], seconds: float) -> float:
    return round(sum(cpu_seconds(p) - before[p] for p in pids) / seconds, 3)


def _machine() -> tuple[float, float]:
    """(busy, all) CPU seconds of this machine so far, every program's (/proc/stat)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]                  # idle, iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks[:8]) - idle) / hz, sum(ticks[:8]) / hz


def run_phase(kind: str, pool: dict[str, Any], procs: int, window: int, seconds: float) -> dict[str, Any]:
    """One phase: its load processes (none when idle), calls/s, and the CPU of each part over the timed span."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    loads = [] if kind == "idle" else [
        ctx.Process(target=_load, args=(kind, pool["frontend"], pool["keys"], pool["routes"], window, seconds, q))
        for _ in range(procs)]
    for p in loads:
        p.start()
    time.sleep(0.5 + WARMUP_S)        # spawn and warm-up; then the CPU over the timed span
    parts = {"broker": [pool["broker"]], "hosts": pool["hosts"], "load": [p.pid for p in loads]}
    before = {pid: cpu_seconds(pid) for pids in parts.values() for pid in pids}
    busy0, _ = _machine()
    time.sleep(seconds)
    cpu = {name: _cores(pids, before, seconds) for name, pids in parts.items()}
    cpu["other programs"] = round(max(0.0, (_machine()[0] - busy0) / seconds - sum(cpu.values())), 3)
    results = [q.get(timeout=60 + seconds) for _ in loads]
    for p in loads:
        p.join(30)
    calls = sum(r["calls"] for r in results)
    out: dict[str, Any] = {"phase": kind, "calls_per_s": round(calls / seconds, 1),
                           "errors": sum(r["errors"] for r in results), "cpu_cores": cpu,
                           "machine_cores": len(os.sched_getaffinity(0)), "load_avg_1m": round(os.getloadavg()[0], 2)}
    if calls:
        per_call = cpu["broker"] * seconds / calls
        out["broker_cpu_us_per_call"] = round(per_call * 1e6, 2)
        out["broker_messages_per_s"] = round(BROKER_MESSAGES[kind] * calls / seconds, 1)
        if per_call and BROKER_MESSAGES[kind]:      # (direct calls do not pass the broker: its CPU is the heartbeats')
            out["broker_ceiling_per_s"] = round(1 / per_call)     # its loop with a core of its own
    out["saturated"] = _saturated(cpu, out["machine_cores"])
    return out


def _saturated(cpu: dict[str, float], cores: int) -> str:
    """What ran out first: the broker's loop (a core), else the machine (its cores, every program's), else nothing."""
    if cpu["broker"] >= 0.9:
        return "the broker (a whole core)"
    if sum(cpu.values()) >= 0.85 * cores:
        ours = {k: v for k, v in cpu.items() if k != "other programs"}
        busiest = max(ours, key=ours.get)
        return f"the machine's {cores} cores (the most of ours to the {busiest}: {cpu[busiest]:.2f})"
    return "nothing measured here"


@contextlib.contextmanager
def stub_pool(hosts: int, workers: int) -> Iterator[dict[str, Any]]:
    """A broker with keys and `hosts` stub processes of `workers` workers each, ready; what the phases need."""
    from benchmarks.common import free_endpoint
    from laya_pool import Client
    from laya_pool.broker.security import generate
    with tempfile.TemporaryDirectory(prefix="laya-scale-") as d:
        keys = f"{d}/keys"
        generate(keys)
        env = dict(os.environ, LAYA_POOL_RUNTIME_DIR=d)
        frontend, backend = free_endpoint(), free_endpoint()
        procs = [subprocess.Popen([sys.executable, "-m", "laya_pool.broker.broker", "--frontend", frontend, "--backend",
                                   backend, "--keys", keys, "--queue-size", "100000", "--liveness", "10",
                                   "--log-level", "WARNING"],
                                  env=env)]
        try:
            time.sleep(1.0)                 # bound before the workers connect
            for h in range(hosts):
                procs.append(subprocess.Popen([sys.executable, "-m", "laya_pool.tools.stub_worker", "--backend",
                                               backend, "--keys", keys, "--id", f"host{h}", "--workers", str(workers),
                                               "--direct-endpoint", f"tcp://127.0.0.{11 + h}:*"], env=env))
            pool = _ready(Client(frontend, keys=keys, timeout=5.0), hosts * workers)
            yield {"frontend": frontend, "keys": keys, "broker": procs[0].pid, "hosts": [p.pid for p in procs[1:]],
                   **pool}
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(10)


def _ready(c: Any, n: int, timeout: float = 120.0) -> dict[str, Any]:
    """Wait until the broker lists `n` ready workers with direct routes; the table of routes."""
    from laya_pool.protocol import wire
    deadline = time.monotonic() + timeout
    with c:
        while True:
            msg, _ = c.call(wire.Cmd.HEARTBEAT, lambda rid, cid: wire.encode(wire.Cmd.HEARTBEAT, {"rid": rid,
                                                                                                   "routes": True}))
            routes = msg.header.get("routes", [])
            if len(routes) >= n:
                return {"routes": routes, "workers": len(c.status()["workers"])}
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(routes)} of {n} stub workers ready after {timeout:g} s")
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--hosts", type=int, default=8, help="stub host processes, each on a loopback address of its own")
    ap.add_argument("--workers", type=int, default=8, help="stub workers per host")
    ap.add_argument("--procs", type=int, default=2, help="load processes")
    ap.add_argument("--window", type=int, default=64, help="calls each load process keeps in flight")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--phases", default=",".join(PHASES), help="comma-separated: " + ", ".join(PHASES))
    args = ap.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    for p in phases:
        if p not in PHASES:
            ap.error(f"unknown phase {p!r}")
    results = []
    with stub_pool(args.hosts, args.workers) as pool:
        print(json.dumps({"workers": pool["workers"], "routes": len(pool["routes"])}))
        for phase in phases:
            r = run_phase(phase, pool, args.procs, args.window, args.seconds)
            results.append(r)
            print(json.dumps(r))
    write(args.out, "scale", {"config": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
