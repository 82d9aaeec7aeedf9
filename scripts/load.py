"""Closed-loop load through a pool: throughput, latency, lost requests, a worker killed mid-run.

Client processes each keep `concurrency / procs` requests in flight over one AsyncClient, sending
pre-encoded rows (`forward`) so the load generator's own tokenisation never limits the pool.

    # scaling: a baseline pool first, then the pool under test, ratio of their throughputs
    python scripts/load.py --model DIR --baseline-devices cuda:0 --devices cuda:0,cuda:1 \\
        --concurrency 64 --seconds 10 --kill-after 4 --out load.json
    # a running pool
    python scripts/load.py --frontend tcp://127.0.0.1:5555 --concurrency 16 --seconds 5

`--kill-after S` SIGKILLs one worker of the pool under test S seconds into its run (the pool must
run on this host); every request must still be answered. Exits 1 if any request was lost.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shlex
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.pool import AsyncClient, Client, local_pool  # noqa: E402


def _rows(n_rows: int, tokens: int) -> list:
    ids = (np.arange(tokens, dtype=np.int32) % 900) + 5
    return [(ids, np.array([1, 3, 5], np.int32), 0) for _ in range(n_rows)]


def _client_proc(endpoint: str, inflight: int, seconds: float, rows_n: int, tokens: int, out: mp.Queue) -> None:
    async def main() -> dict:
        rows = _rows(rows_n, tokens)
        lat: list[float] = []
        failed: list[str] = []
        stop = time.monotonic() + seconds
        async with AsyncClient(endpoint, timeout=10.0, retries=6) as c:
            async def loop() -> None:
                while time.monotonic() < stop:
                    t0 = time.perf_counter()
                    try:
                        await c.forward(rows)
                        lat.append(time.perf_counter() - t0)
                    except Exception as e:  # a lost request is the result we report, not a crash
                        failed.append(f"{type(e).__name__}: {e}")
            await asyncio.gather(*(loop() for _ in range(inflight)))
        return {"latencies": lat, "failed": failed}
    out.put(asyncio.run(main()))


def _killer(endpoint: str, after: float, done: dict) -> None:
    time.sleep(after)
    with Client(endpoint, timeout=5.0, retries=2) as c:
        workers = [w for w in c.status()["workers"] if w["state"] == "ready" and w.get("pid")]
    victim = workers[0]
    os.kill(victim["pid"], signal.SIGKILL)
    t_kill = time.monotonic()
    done.update(killed=victim["id"], pid=victim["pid"], device=victim["device"], at_s=after)
    with Client(endpoint, timeout=5.0, retries=2) as c:
        while time.monotonic() - t_kill < 300:          # the supervisor brings it back with a new pid
            back = [w for w in c.status()["workers"]
                    if w["id"] == victim["id"] and w["state"] == "ready" and w.get("pid") != victim["pid"]]
            if back:
                done["ready_again_s"] = round(time.monotonic() - t_kill, 2)
                return
            time.sleep(0.2)


def run_load(endpoint: str, *, concurrency: int, procs: int, seconds: float, rows: int, tokens: int,
             kill_after: float | None = None) -> dict:
    """Drive `endpoint` for `seconds` with `concurrency` requests in flight; returns the measurements."""
    warm_failed = []
    with Client(endpoint, timeout=10.0, retries=3) as c:       # one warm call apart, not timed
        try:
            c.forward(_rows(rows, tokens))
        except Exception as e:
            warm_failed.append(f"{type(e).__name__}: {e}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    shares = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    children = [ctx.Process(target=_client_proc, args=(endpoint, s, seconds, rows, tokens, q))
                for s in shares if s > 0]
    t0 = time.perf_counter()
    for p in children:
        p.start()
    killed: dict = {}
    if kill_after is not None:
        killer = threading.Thread(target=_killer, args=(endpoint, kill_after, killed), daemon=True)
        killer.start()
    parts = [q.get(timeout=seconds + 120) for _ in children]
    if kill_after is not None:
        killer.join(300)
    wall = time.perf_counter() - t0
    for p in children:
        p.join(30)
    lat = sorted(x for part in parts for x in part["latencies"])
    failed = warm_failed + [x for part in parts for x in part["failed"]]
    ms = [x * 1e3 for x in lat]
    return {"endpoint": endpoint, "concurrency": concurrency, "procs": len(children), "seconds": seconds,
            "rows": rows, "tokens": tokens, "answered": len(lat), "lost": len(failed), "errors": failed[:5],
            "throughput_rps": len(lat) / wall, "p50_ms": statistics.median(ms) if ms else None,
            "p95_ms": ms[int(0.95 * (len(ms) - 1))] if ms else None, "killed": killed or None}


def _pool_run(args: argparse.Namespace, devices: str, wpd: int, kill_after: float | None, extra: str) -> dict:
    """One pool: a clean measurement, then (with kill_after) a second run with a worker SIGKILLed.

    The throughput of the clean run is the one scaling ratios use: a run that loses a worker for
    part of its time measures the restart, not the pool."""
    def go(pool, kill):
        return run_load(pool.endpoint, concurrency=args.concurrency, procs=args.procs, seconds=args.seconds,
                        rows=args.rows, tokens=args.tokens, kill_after=kill)
    with local_pool(args.model, devices=devices, workers_per_device=wpd, startup_timeout=600,
                    extra_args=shlex.split(extra)) as pool:
        res = go(pool, None)
        res.update(devices=devices, workers_per_device=wpd, pool_args=extra)
        if kill_after is not None:
            res["with_kill"] = go(pool, kill_after)
        return res


def _line(name: str, r: dict) -> str:
    ms = "  ".join(f"{k} {r[k + '_ms']:7.2f} ms" if r[k + "_ms"] is not None else f"{k} -" for k in ("p50", "p95"))
    s = f"{name:44s} {r['throughput_rps']:8.1f} req/s  {ms}  answered {r['answered']}  lost {r['lost']}"
    if r.get("killed"):
        k = r["killed"]
        s += f"  (worker {k['killed']} killed at {k['at_s']} s, ready again {k.get('ready_again_s', 'never')} s later)"
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frontend", help="a running pool (else --model starts pools)")
    ap.add_argument("--model")
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--workers-per-device", type=int, default=1)
    ap.add_argument("--baseline-devices", help="run a baseline pool on these devices first and report the ratio")
    ap.add_argument("--baseline-workers-per-device", type=int, default=1)
    ap.add_argument("--pool-args", default="", help="extra `laya-pool up` arguments for the pool under test")
    ap.add_argument("--baseline-args", default="", help="extra `laya-pool up` arguments for the baseline pool")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4, help="client processes sharing the concurrency")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--kill-after", type=float, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not args.frontend and not args.model:
        ap.error("give --frontend or --model")
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.frontend:
        report["pool"] = run_load(args.frontend, concurrency=args.concurrency, procs=args.procs,
                                  seconds=args.seconds, rows=args.rows, tokens=args.tokens,
                                  kill_after=args.kill_after)
        print(_line("pool", report["pool"]))
    else:
        if args.baseline_devices:
            report["baseline"] = _pool_run(args, args.baseline_devices, args.baseline_workers_per_device, None,
                                           args.baseline_args)
            print(_line(f"baseline {args.baseline_devices} x{args.baseline_workers_per_device} {args.baseline_args}",
                        report["baseline"]))
        report["pool"] = _pool_run(args, args.devices, args.workers_per_device, args.kill_after, args.pool_args)
        print(_line(f"pool {args.devices} x{args.workers_per_device} {args.pool_args}", report["pool"]))
        if "with_kill" in report["pool"]:
            report["with_kill"] = report["pool"].pop("with_kill")
            print(_line(f"pool {args.devices} x{args.workers_per_device}, kill", report["with_kill"]))
        if args.baseline_devices:
            report["ratio"] = report["pool"]["throughput_rps"] / report["baseline"]["throughput_rps"]
            print(f"throughput ratio pool / baseline: {report['ratio']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    lost = sum(r["lost"] for k, r in report.items() if isinstance(r, dict) and "lost" in r)
    if lost:
        first = next(r["errors"][0] for r in report.values() if isinstance(r, dict) and r.get("errors"))
        print(f"LOST {lost} requests; first error: {first}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
