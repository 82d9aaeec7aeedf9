"""Closed-loop load through a pool: throughput, latency, lost requests, a worker killed mid-run.

Client processes each keep `concurrency / procs` requests in flight over one AsyncClient, sending
pre-encoded rows (`forward`) so the load generator's own tokenisation never limits the pool.
`--concurrency 1,4,16,64,256` sweeps (one pool, every level in turn) and draws the curve (`--png`);
`--mix 1x48:8,4x256:2,16x512:1` sends a mixed load (shapes ROWSxTOKENS drawn with those weights),
with latency reported per shape too. Throughput counts the answers that come within `--seconds`, a window every client
process begins at the same moment, after all of them have started. Each run also says how a CUDA worker's device
spent it (`device_time`: busy, and idle between a forward's landing and the next launch), from the stamps every reply
carries.

    # scaling: a baseline pool first, then the pool under test, ratio of their throughputs
    laya-pool load --model DIR --baseline-devices cuda:0 --devices cuda:0,cuda:1 \\
        --concurrency 64 --seconds 10 --kill-after 4 --out load.json
    # a running pool
    laya-pool load --frontend tcp://127.0.0.1:5555 --concurrency 16 --seconds 5
    # a sweep of a mixed load, batching against none, with the curve
    laya-pool load --model DIR --baseline-args "--max-batch 1" --pool-args "--max-batch 32" \
        --concurrency 1,4,16,64,256 --mix 1x48:8,4x256:2,16x512:1 --seconds 5 --out sweep.json --png sweep.png

`--kill-after S` SIGKILLs one worker of the pool under test S seconds into its run (the pool must
run on this host); every request must still be answered. Exits 1 if any request was lost.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import shlex
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from laya_pool.client.local import local_pool  # noqa: E402
from laya_pool.client.pool import Client  # noqa: E402
from laya_pool.client.pool_async import AsyncClient  # noqa: E402
from laya_pool.protocol import contract  # noqa: E402

from . import cpu  # noqa: E402
from .progress import Progress, enabled  # noqa: E402

QUIET = False           # --quiet: no progress bar
# A worker's stats reach the broker with its heartbeat, sent once a heartbeat interval passed, checked every half one.
HEARTBEAT_S = 1.5 * contract.HEARTBEAT_MS / 1e3 + 0.2
START_S = 120.0         # the longest the client processes may take to start together


def _rows(n_rows: int, tokens: int) -> list:
    ids = (np.arange(tokens, dtype=np.int32) % 900) + 5
    return [(ids, np.array([1, 3, 5], np.int32), 0) for _ in range(n_rows)]


Shape = tuple[int, int, float]        # rows, tokens, weight


def parse_mix(text: str) -> list[Shape]:
    """`"1x48:8,16x512"` -> [(1, 48, 8.0), (16, 512, 1.0)]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        shape, _, weight = part.partition(":")
        try:
            rows, tokens = (int(x) for x in shape.lower().split("x"))
            w = float(weight) if weight else 1.0
        except ValueError as e:
            raise ValueError(f"bad shape {part!r}: expected ROWSxTOKENS[:WEIGHT], e.g. 4x256:2") from e
        if rows < 1 or tokens < 6 or w <= 0:
            raise ValueError(f"bad shape {part!r}: rows >= 1, tokens >= 6 (three markers), weight > 0")
        out.append((rows, tokens, w))
    if not out:
        raise ValueError("no shapes")
    return out


def _client_proc(endpoint: str, inflight: int, seconds: float, mix: list[Shape], seed: int, out: mp.Queue,
                 gate: Any, direct: bool = True, keys: str | None = None, lanes: bool = True,
                 bundles: bool = True, together: bool = False) -> None:
    """One client process: `inflight` loops over one AsyncClient, from the moment every process has started (`gate`,
    a barrier the parent passes too) for `seconds`; `in_window` counts the answers that came within them."""
    import random

    async def main() -> dict:
        shapes = [_rows(r, t) for r, t, _ in mix]
        names = [f"{r}x{t}" for r, t, _ in mix]
        weights = [w for _, _, w in mix]
        lat: dict[str, list[float]] = {n: [] for n in names}
        failed: list[str] = []
        stamps: set[tuple] = set()          # one per forward: its members' replies carry the same stamps
        in_window = 0
        async with AsyncClient(endpoint, timeout=10.0, retries=6, direct=direct, keys=keys, lanes=lanes,
                               bundles=bundles, together=together) as c:
            # Python and the imports take ~0.5 s a process to start: no clock runs before the last one is up
            await asyncio.get_running_loop().run_in_executor(None, gate.wait, START_S)
            stop = time.monotonic() + seconds

            async def loop(k: int) -> None:
                nonlocal in_window
                rng = random.Random(seed * 1000 + k)      # the same draw sequence run after run
                while time.monotonic() < stop:
                    i = rng.choices(range(len(shapes)), weights)[0] if len(shapes) > 1 else 0
                    t0 = time.perf_counter()
                    try:
                        res = await c.forward(shapes[i])
                        lat[names[i]].append(time.perf_counter() - t0)
                        in_window += time.monotonic() <= stop
                        m = res.metrics
                        if "launched_at" in m and "landed_at" in m:
                            stamps.add((res.worker, m["launched_at"], m["landed_at"], m.get("batched", 1)))
                    except Exception as e:  # a lost request is the result we report, not a crash
                        failed.append(f"{type(e).__name__}: {e}")
            await asyncio.gather(*(loop(k) for k in range(inflight)))
            r = c._routes
            paths = {"direct": r.sent, "on_lanes": r.on_lanes, "dropped": r.dropped} if r is not None else {}
        return {"latencies": lat, "failed": failed, "paths": paths, "stamps": sorted(stamps), "in_window": in_window}
    out.put(asyncio.run(main()))


def _stats(seconds: list[float]) -> dict:
    ms = sorted(x * 1e3 for x in seconds)
    return {"answered": len(ms), "p50_ms": statistics.median(ms) if ms else None,
            "p95_ms": ms[int(0.95 * (len(ms) - 1))] if ms else None}


COUNTS = ("ok", "merged_runs", "merged_requests", "bundles", "bundled", "requests_messages")
# What reached the broker: every message from a client (asks for the route table included), and its REQUEST messages
# (first attempts and retries: cache hits and refusals too).
BROKER_COUNTS = ("frontend_messages", "requests")


def _worker_counts(endpoint: str, keys: str | None = None) -> dict[tuple[str, Any], tuple[int, ...]]:
    """Requests answered and merged per worker process ((id, pid): a restarted worker counts from 0 again), from
    their last heartbeat's stats; under the key "broker", the broker's counts of BROKER_COUNTS."""
    with Client(endpoint, timeout=5.0, retries=2, keys=keys) as c:
        status = c.status()
    out: dict = {(w["id"], w.get("pid")): tuple(int((w.get("stats") or {}).get(k) or 0) for k in COUNTS)
                 for w in status["workers"]}
    counters = (status.get("broker") or {}).get("counters") or {}
    out["broker"] = tuple(int(counters.get(k) or 0) for k in BROKER_COUNTS)
    return out


def groups(before: dict, after: dict) -> dict | None:
    """Forwards and the mean group (requests per forward) between two `_worker_counts`; None if a worker process
    came or went between them (its counts cover another window); pure."""
    if set(before) != set(after):
        return None
    workers = [w for w in after if w != "broker"]
    ok, runs, merged, bundles, bundled, together = (sum(after[w][i] - before[w][i] for w in workers)
                                                    for i in range(len(COUNTS)))
    forwards = runs + ok - merged
    out = {"requests": ok, "forwards": forwards, "mean_group": round(ok / forwards, 2) if forwards else None,
           "bundles": bundles, "bundled": bundled, "requests_messages": together}
    if "broker" in after:
        out["broker"] = {k: after["broker"][i] - before["broker"][i] for i, k in enumerate(BROKER_COUNTS)}
    return out


def device_time(stamps: list[tuple], since: float | None = None) -> dict | None:
    """How each worker's device spent the run, from its forwards' stamps (worker, launched_at, landed_at, requests;
    the worker's monotonic clock, which a client on its host shares), forwards launched before `since` left out; pure.

    Forwards run in launch order on a worker's stream, so a forward could start at its launch or when the one before
    it landed, whichever came later: it kept the device from then to its landing (`busy`), and the device had nothing
    queued between a landing and a later launch (`idle`); between its first landing and its last a worker's device
    is one or the other, so `busy` is 1 - `idle` (spans summed over workers). A landing is stamped the first time the
    worker sees it (worker/runtime.py `Launched.done`: the data thread looks between its socket reads), so `idle` may
    be short by one look."""
    by_worker: dict[Any, list[tuple]] = {}
    for worker, launched, landed, n in set(stamps):      # each client process that shared a forward reports it
        if since is None or launched >= since:
            by_worker.setdefault(worker, []).append((launched, landed, n))
    idle = span = 0.0
    after = 0
    per: list[float] = []                              # each forward's time on the device
    for rows in by_worker.values():
        rows.sort()
        if len(rows) < 2:
            continue
        prev = rows[0][1]
        span += rows[-1][1] - prev
        for launched, landed, _ in rows[1:]:          # the first one's start is unknown (what ran before it)
            per.append(landed - max(launched, prev))
            if launched > prev:
                idle += launched - prev
                after += 1
            prev = landed
    if not per or span <= 0:
        return None
    return {"forwards": len(per), "busy": round(1 - idle / span, 4), "idle": round(idle / span, 4),
            "launched_after_landing": after, "forward_ms": round(statistics.median(per) * 1e3, 3)}


def _killer(endpoint: str, after: float, done: dict, keys: str | None = None) -> None:
    time.sleep(after)
    with Client(endpoint, timeout=5.0, retries=2, keys=keys) as c:
        workers = [w for w in c.status()["workers"] if w["state"] == "ready" and w.get("pid")]
    victim = workers[0]
    os.kill(victim["pid"], signal.SIGKILL)
    t_kill = time.monotonic()
    done.update(killed=victim["id"], pid=victim["pid"], device=victim["device"], at_s=after)
    with Client(endpoint, timeout=5.0, retries=2, keys=keys) as c:
        while time.monotonic() - t_kill < 300:          # the supervisor brings it back with a new pid
            back = [w for w in c.status()["workers"]
                    if w["id"] == victim["id"] and w["state"] == "ready" and w.get("pid") != victim["pid"]]
            if back:
                done["ready_again_s"] = round(time.monotonic() - t_kill, 2)
                return
            time.sleep(0.2)


def _collect(q: mp.Queue, n: int, seconds: float, t0: float, label: str) -> list[dict]:
    """The children's results, with a progress bar over the run's seconds meanwhile (stderr, a TTY only)."""
    parts: list[dict] = []
    deadline = time.monotonic() + seconds + 120
    with Progress(seconds, label, enabled(QUIET)) as bar:
        while len(parts) < n:
            try:
                parts.append(q.get(timeout=0.2))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise
            bar.set(round(min(seconds, time.perf_counter() - t0), 1))
    return parts


def _sample_cpu(pool_pids, children: list, seconds: float, out: list) -> None:
    """CPU use of the pool's processes (`pool_pids()`: pid -> role, or None) and the client processes over the
    middle of the run (from a fifth in to a tenth before the end, so every client is connected and none has left)."""
    time.sleep(0.2 * seconds)
    pids = {**(pool_pids() if pool_pids else {}), **{p.pid: "client" for p in children}}
    t0, before = time.monotonic(), cpu.snapshot(pids)
    time.sleep(0.7 * seconds)
    out.extend(cpu.usage(before, cpu.snapshot(pids), time.monotonic() - t0))


def run_load(endpoint: str, *, concurrency: int, procs: int, seconds: float, rows: int = 1, tokens: int = 48,
             kill_after: float | None = None, mix: list[Shape] | None = None, pool_pids=None,
             direct: bool = True, keys: str | None = None, lanes: bool = True, bundles: bool = True,
             together: bool = False) -> dict:
    """Drive `endpoint` for `seconds` with `concurrency` requests in flight (of `rows` x `tokens`, or drawn
    from `mix`); returns the measurements, with the CPU each process used (`pool_pids`: a callable giving the
    pool's pids and roles, for a pool on this host). `keys`: a pool with CURVE keys (`laya-pool keys`)."""
    mix = mix or [(rows, tokens, 1.0)]
    warm_failed, on_cuda = _warm(endpoint, mix, keys)
    time.sleep(HEARTBEAT_S)                    # the warm calls in the workers' stats
    counted = _worker_counts(endpoint, keys)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    children = _start_clients(ctx, q, endpoint, concurrency, procs, seconds, mix,
                              (direct, keys, lanes, bundles, together))
    t0 = time.perf_counter()
    killed: dict = {}
    if kill_after is not None:
        killer = threading.Thread(target=_killer, args=(endpoint, kill_after, killed, keys), daemon=True)
        killer.start()
    used: list[dict] = []
    sampler = threading.Thread(target=_sample_cpu, args=(pool_pids, children, seconds, used), daemon=True)
    sampler.start()
    parts = _collect(q, len(children), seconds, t0, f"load, {concurrency} in flight")
    sampler.join(seconds + 5)
    if kill_after is not None:
        killer.join(300)
    for p in children:
        p.join(30)
    time.sleep(HEARTBEAT_S)                    # the run's last requests in the workers' stats
    grouped = groups(counted, _worker_counts(endpoint, keys))
    run = {"endpoint": endpoint, "concurrency": concurrency, "procs": len(children), "seconds": seconds}
    return _summary(run, parts, mix, warm_failed, on_cuda, killed, grouped, used)


def _warm(endpoint: str, mix: list[Shape], keys: str | None) -> tuple[list[str], set[str]]:
    """One warm call per shape apart, not timed: (what failed, the ids of the CUDA workers)."""
    warm_failed = []
    with Client(endpoint, timeout=10.0, retries=3, keys=keys) as c:
        for r, t, _ in mix:
            try:
                c.forward(_rows(r, t))
            except Exception as e:
                warm_failed.append(f"{type(e).__name__}: {e}")
        # a CPU worker computes inside its launch, so its stamps say nothing of a device: only CUDA workers' count
        on_cuda = {w["id"] for w in c.status()["workers"] if str(w.get("device", "")).startswith("cuda")}
    return warm_failed, on_cuda


def _start_clients(ctx: Any, q: Any, endpoint: str, concurrency: int, procs: int, seconds: float, mix: list[Shape],
                   options: tuple) -> list:
    """`procs` client processes sharing `concurrency` requests in flight, started together (a barrier);
    `options`: (direct, keys, lanes, bundles, together) for `_client_proc`."""
    procs = max(1, min(procs, concurrency))
    shares = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    gate = ctx.Barrier(procs + 1)
    children = [ctx.Process(target=_client_proc, args=(endpoint, n, seconds, mix, i, q, gate, *options))
                for i, n in enumerate(shares)]
    for p in children:
        p.start()
    try:
        gate.wait(START_S)
    except threading.BrokenBarrierError:
        for p in children:
            p.kill()
        raise RuntimeError(f"the {procs} client processes did not all start within {START_S:.0f} s") from None
    return children


def _summary(run: dict, parts: list[dict], mix: list[Shape], warm_failed: list[str], on_cuda: set[str], killed: dict,
             grouped: Any, used: list[dict]) -> dict:
    """The run's measurements (`run`: endpoint, concurrency, procs, seconds) from the client processes' parts."""
    per_shape = {f"{r}x{t}": [x for part in parts for x in part["latencies"][f"{r}x{t}"]] for r, t, _ in mix}
    everything = [x for xs in per_shape.values() for x in xs]
    failed = warm_failed + [x for part in parts for x in part["failed"]]
    total = _stats(everything)
    in_window = sum(part["in_window"] for part in parts)
    # the device's time from the forwards' own stamps, the first second left out (the ramp: every loop's first
    # request comes at once, before the worker's groups settle)
    stamps = [tuple(x) for part in parts for x in part.get("stamps", []) if x[0] in on_cuda]
    device = device_time(stamps, since=min((x[1] for x in stamps), default=0.0) + 1.0) if not killed else None
    out = {**run, "rows": mix[0][0], "tokens": mix[0][1], "answered": total["answered"], "lost": len(failed),
           "errors": failed[:5], "p50_ms": total["p50_ms"],
           # the answers within the run's seconds, which every client process began at once: not those that came
           # after (they were sent within it) nor the processes' start-up (0.5 s or more, 6% of an 8 s run)
           "in_window": in_window, "throughput_rps": in_window / run["seconds"],
           "p95_ms": total["p95_ms"], "killed": killed or None, "groups": grouped, "device": device, "cpu": used,
           "paths": {k: sum(part["paths"].get(k, 0) for part in parts) for k in ("direct", "on_lanes", "dropped")}}
    if len(mix) > 1:
        out["mix"] = [[r, t, w] for r, t, w in mix]
        out["per_shape"] = {k: _stats(v) for k, v in per_shape.items()}
    return out


def _pool_run(args: argparse.Namespace, devices: str, wpd: int, kill_after: float | None, extra: str) -> dict:
    """One pool: a clean measurement at each concurrency, then (with kill_after) a second run at the last one
    with a worker SIGKILLed.

    The throughput of the clean run is the one scaling ratios use: a run that loses a worker for
    part of its time measures the restart, not the pool."""
    def go(pool, concurrency, kill):
        return run_load(pool.endpoint, concurrency=concurrency, procs=args.procs, seconds=args.seconds,
                        rows=args.rows, tokens=args.tokens, kill_after=kill, mix=args.mix,
                        pool_pids=lambda: cpu.tree(pool.process.pid), direct=not args.via_broker,
                        keys=args.keys, lanes=not args.no_lanes, bundles=not args.no_bundles,
                        together=args.together)
    with local_pool(args.model, devices=devices, workers_per_device=wpd, startup_timeout=600,
                    extra_args=shlex.split(extra), keys=args.keys) as pool:
        runs = [go(pool, n, None) for n in args.concurrency]
        res = dict(runs[-1], devices=devices, workers_per_device=wpd, pool_args=extra)
        if len(runs) > 1:
            res["sweep"] = runs
        if kill_after is not None:
            res["with_kill"] = go(pool, args.concurrency[-1], kill_after)
        return res


def plot(report: dict, path: str) -> None:
    """Throughput and latency against concurrency, one line per pool."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tp, lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in ("baseline", "pool"):
        r = report.get(name)
        if not r:
            continue
        runs = r.get("sweep") or [r]
        label = f"{name} {r.get('devices', '')} {r.get('pool_args', '')}".strip()
        xs = [x["concurrency"] for x in runs]
        tp.plot(xs, [x["throughput_rps"] for x in runs], "o-", label=label)
        lat.plot(xs, [x["p50_ms"] for x in runs], "o-", label=f"{label} p50")
        lat.plot(xs, [x["p95_ms"] for x in runs], "o--", label=f"{label} p95", alpha=0.6)
    for ax, ylabel in ((tp, "requests / s"), (lat, "latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    lat.set_yscale("log")
    mix = (report.get("pool") or {}).get("mix")
    fig.suptitle("closed-loop load" + (f", mix {mix}" if mix else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _line(name: str, r: dict) -> str:
    ms = "  ".join(f"{k} {r[k + '_ms']:7.2f} ms" if r[k + "_ms"] is not None else f"{k} -" for k in ("p50", "p95"))
    s = (f"{name:44s} {r['concurrency']:4d} in flight {r['throughput_rps']:8.1f} req/s  {ms}  "
         f"answered {r['answered']}  lost {r['lost']}")
    g = r.get("groups") or {}
    if g.get("mean_group"):
        s += f"  mean group {g['mean_group']}"
    if g.get("bundles") or g.get("requests_messages"):
        s += (f"\n    replies in bundles {g['bundled']} ({g['bundles']} bundles), "
              f"REQUESTS messages {g['requests_messages']}")
    broker = (r.get("groups") or {}).get("broker")
    if r.get("paths") or broker:
        # where the attempts went: the clients' direct sends (on lanes among them), what the broker saw
        p = r.get("paths") or {}
        s += (f"\n    attempts direct {p.get('direct', 0)} (on lanes {p.get('on_lanes', 0)}, dropped "
              f"{p.get('dropped', 0)})")
        if broker:
            s += f"; broker: {broker['frontend_messages']} client messages, {broker['requests']} request messages"
    d = r.get("device")
    if d:
        s += (f"\n    device (the forwards' stamps): busy {d['busy']:.1%}, idle between forwards {d['idle']:.1%} "
              f"({d['launched_after_landing']} of {d['forwards']} launched after the one before landed), "
              f"{d['forward_ms']} ms a forward (median)")
    if r.get("killed"):
        k = r["killed"]
        s += f"  (worker {k['killed']} killed at {k['at_s']} s, ready again {k.get('ready_again_s', 'never')} s later)"
    if r.get("cpu"):
        s += "\n    " + cpu.summary(r["cpu"])
    return s


def main() -> int:
    ap = _parser()
    args = ap.parse_args()
    global QUIET
    QUIET = args.quiet
    if not args.frontend and not args.model:
        ap.error("give --frontend or --model")
    try:
        args.concurrency = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
        args.mix = parse_mix(args.mix) if args.mix else None
    except ValueError as e:
        ap.error(str(e))
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error("--concurrency: positive integers")
    report = _measure(args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.png:
        plot(report, args.png)
    runs = [x for r in report.values() if isinstance(r, dict) for x in (r.get("sweep") or [r]) if "lost" in x]
    lost = sum(x["lost"] for x in runs)
    if lost:
        first = next(x["errors"][0] for x in runs if x.get("errors"))
        print(f"LOST {lost} requests; first error: {first}")
    return 1 if lost else 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--frontend", help="a running pool (else --model starts pools)")
    ap.add_argument("--model")
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--workers-per-device", type=int, default=1)
    ap.add_argument("--baseline-devices", help="run a baseline pool on these devices first and report the ratio")
    ap.add_argument("--baseline-workers-per-device", type=int, default=1)
    ap.add_argument("--pool-args", default="", help="extra `laya-pool up` arguments for the pool under test")
    ap.add_argument("--baseline-args", default="", help="extra `laya-pool up` arguments for the baseline pool")
    ap.add_argument("--concurrency", default="64", help="requests in flight; a list (1,4,16) sweeps")
    ap.add_argument("--procs", type=int, default=4, help="client processes sharing the concurrency")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--mix", default=None, help="a mixed load: ROWSxTOKENS[:WEIGHT],... (instead of --rows/--tokens)")
    ap.add_argument("--kill-after", type=float, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None, help="draw throughput and latency against concurrency here")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (there is none when stderr is not a TTY)")
    ap.add_argument("--via-broker", action="store_true",
                    help="the clients (AsyncClient) send every request through the broker (direct=False); by default "
                         "first attempts go to the workers directly where the pool offers it, as AsyncClient's do")
    ap.add_argument("--no-lanes", action="store_true",
                    help="the clients send nothing through shared memory (AsyncClient(lanes=False)), for A/B runs")
    ap.add_argument("--no-bundles", action="store_true",
                    help="the clients take every reply alone (AsyncClient(bundles=False)), for A/B runs")
    ap.add_argument("--together", action="store_true",
                    help="the clients send one event-loop turn's requests in one message (AsyncClient(together=True)), "
                         "for A/B runs")
    ap.add_argument("--keys", help="a pool with CURVE keys: the `laya-pool keys` directory (the pools this starts "
                                   "use it too)")
    return ap


def _measure(args: argparse.Namespace) -> dict:
    """The report: a running pool (--frontend) at each concurrency, or the pools this starts (and a baseline)."""
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.frontend:
        runs = [run_load(args.frontend, concurrency=n, procs=args.procs, seconds=args.seconds, rows=args.rows,
                         tokens=args.tokens, kill_after=args.kill_after if n == args.concurrency[-1] else None,
                         mix=args.mix, direct=not args.via_broker, keys=args.keys, lanes=not args.no_lanes,
                         bundles=not args.no_bundles, together=args.together)
                for n in args.concurrency]
        report["pool"] = dict(runs[-1], sweep=runs) if len(runs) > 1 else runs[0]
        for r in runs:
            print(_line("pool", r))
    else:
        if args.baseline_devices or args.baseline_args:
            report["baseline"] = _pool_run(args, args.baseline_devices or args.devices,
                                           args.baseline_workers_per_device, None, args.baseline_args)
            for r in report["baseline"].get("sweep") or [report["baseline"]]:
                print(_line(f"baseline {args.baseline_devices or args.devices} x{args.baseline_workers_per_device} "
                            f"{args.baseline_args}", r))
        report["pool"] = _pool_run(args, args.devices, args.workers_per_device, args.kill_after, args.pool_args)
        for r in report["pool"].get("sweep") or [report["pool"]]:
            print(_line(f"pool {args.devices} x{args.workers_per_device} {args.pool_args}", r))
        if "with_kill" in report["pool"]:
            report["with_kill"] = report["pool"].pop("with_kill")
            print(_line(f"pool {args.devices} x{args.workers_per_device}, kill", report["with_kill"]))
        if "baseline" in report:
            report["ratio"] = report["pool"]["throughput_rps"] / report["baseline"]["throughput_rps"]
            print(f"throughput ratio pool / baseline (at concurrency {args.concurrency[-1]}): {report['ratio']:.2f}x")
    return report


if __name__ == "__main__":
    sys.exit(main())
