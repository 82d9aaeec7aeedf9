"""How fast each CPU of this host runs a fixed piece of Python, alone and beside a second spinner on another CPU.

A VM shows its vCPUs as equal cores (`lscpu`: one thread per core, one L3), but two vCPUs can be one physical core's
hyperthreads, or share it with another tenant; a spinning thread on either then slows the other. The pool's client
and data threads both spin, and the judge's overhead moved 0.19-0.50 ms between runs on one host with no steal and no
preemption (docs/PERF.md, thirty-fifth session). This says whether CPUs differ and which pairs slow each other.

    python3 scripts/cpu_speed.py [--passes 2] [--pairs] [--phases SECONDS] [--json OUT]

`--phases`: every CPU timed at once, a short sample after another, for SECONDS: how long a CPU stays at one speed
(a shared core is slow while its other user runs and fast while that one idles), and how many are fast at a time.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

WORK = 200_000          # loop turns a sample (~10 ms of CPython on these hosts)


def spin_sample(turns: int = WORK) -> float:
    """Microseconds for `turns` turns of a small arithmetic loop on this thread."""
    t = time.perf_counter()
    x = 0
    for i in range(turns):
        x = (x + i) & 0xFFFF
    return (time.perf_counter() - t) * 1e6


def speed_on(cpu: int, samples: int) -> float:
    """Median sample time (us) with this process pinned to `cpu`."""
    os.sched_setaffinity(0, {cpu})
    spin_sample(WORK // 10)
    return statistics.median(spin_sample() for _ in range(samples))


def _busy(cpu: int, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    while not stop.is_set():
        spin_sample(10_000)


def paired(cpu: int, other: int, samples: int) -> float:
    """Median sample time on `cpu` while another process spins on `other`."""
    stop = mp.Event()
    p = mp.Process(target=_busy, args=(other, stop), daemon=True)
    p.start()
    time.sleep(0.02)
    try:
        return speed_on(cpu, samples)
    finally:
        stop.set()
        p.join(2)


def slowed_pairs(alone: dict[int, float], beside: dict[tuple[int, int], float],
                 threshold: float = 1.15) -> list[tuple[int, int, float]]:
    """(cpu, other, ratio) for each pair where a spinner on `other` slowed `cpu` by `threshold` or more; pure."""
    out = []
    for (cpu, other), t in sorted(beside.items()):
        ratio = t / alone[cpu]
        if ratio >= threshold:
            out.append((cpu, other, round(ratio, 2)))
    return out


SHORT = 20_000          # loop turns a phase sample (~1-2 ms)


def _timeline(cpu: int, seconds: float, out) -> None:
    """(start s, sample us) pairs on `cpu` for `seconds`, back to back, sent on `out`."""
    os.sched_setaffinity(0, {cpu})
    spin_sample(SHORT)
    t0 = time.perf_counter()
    series = []
    while (t := time.perf_counter() - t0) < seconds:
        series.append((t, spin_sample(SHORT)))
    out.send(series)


def timelines(cpus: list[int], seconds: float) -> dict[int, list[tuple[float, float]]]:
    """Every CPU's samples over the same window, one process each."""
    pipes = {c: mp.Pipe(duplex=False) for c in cpus}
    procs = [mp.Process(target=_timeline, args=(c, seconds, pipes[c][1]), daemon=True) for c in cpus]
    for p in procs:
        p.start()
    series = {c: pipes[c][0].recv() for c in cpus}
    for p in procs:
        p.join(2)
    return series


def phases(series: list[tuple[float, float]], fastest: float, slow: float = 1.3, window: int = 5) -> dict[str, float]:
    """One CPU's timeline cut into runs of fast and slow samples (slow: `slow` x `fastest` or more, a sample's speed the
    median of the `window` around it, so that one interrupt does not make a phase); pure. The share of time it ran
    fast, how many times it changed speed, and the median length of its runs (s)."""
    runs: list[tuple[bool, float]] = []          # (fast, length s)
    half = window // 2
    for i, (t, us) in enumerate(series):
        fast = statistics.median(v for _, v in series[max(0, i - half):i + half + 1]) < slow * fastest
        end = series[i + 1][0] if i + 1 < len(series) else t + us / 1e6
        if runs and runs[-1][0] == fast:
            runs[-1] = (fast, runs[-1][1] + end - t)
        else:
            runs.append((fast, end - t))
    total = sum(length for _, length in runs) or 1.0
    lengths = sorted(length for _, length in runs)
    return {"fast_share": round(sum(length for fast, length in runs if fast) / total, 3),
            "changes": len(runs) - 1 if runs else 0,
            "median_run_s": round(lengths[len(lengths) // 2], 3) if lengths else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=2, help="times over every CPU alone (does a CPU's speed drift?)")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--pairs", action="store_true", help="every ordered pair: CPU a timed while b spins")
    ap.add_argument("--phases", type=float, default=0.0, help="every CPU at once for this many seconds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    passes = [{c: speed_on(c, args.samples) for c in cpus} for _ in range(args.passes)]
    alone = {c: min(p[c] for p in passes) for c in cpus}
    fastest = min(alone.values())
    print(f"{len(cpus)} CPUs; a sample alone, us (pass 1 .. {args.passes}), and against the fastest CPU:")
    for c in cpus:
        print(f"  cpu {c:3d}  " + "  ".join(f"{p[c]:8.0f}" for p in passes) + f"   x{alone[c] / fastest:.2f}")
    report = {"cpus": cpus, "passes": [{str(c): v for c, v in p.items()} for p in passes]}
    if args.pairs:
        beside = {(a, b): paired(a, b, 3) for a in cpus for b in cpus if a != b}
        slow = slowed_pairs(alone, beside)
        print(f"pairs where a spinner on the second CPU slowed the first by >= 15%: {len(slow)} of {len(beside)}")
        for a, b, r in slow:
            print(f"  cpu {a} beside {b}: x{r}")
        report["slowed_pairs"] = slow
    if args.phases:
        series = timelines(cpus, args.phases)
        quickest = min(us for s in series.values() for _, us in s)
        report["phases"] = {str(c): phases(series[c], quickest) for c in cpus}
        print(f"every CPU at once for {args.phases:g} s ({SHORT} turns a sample; slow: x1.3 the quickest sample, "
              f"{quickest:.0f} us): share of time fast, speed changes, median run")
        for c in cpus:
            p = report["phases"][str(c)]
            print(f"  cpu {c:3d}  fast {p['fast_share']:5.1%}  changes {p['changes']:4d}  "
                  f"run {p['median_run_s']:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
