"""How fast each CPU of this host runs a fixed piece of Python, alone and beside a second spinner on another CPU.

A VM shows its vCPUs as equal cores (`lscpu`: one thread per core, one L3), but two vCPUs can be one physical core's
hyperthreads, or share it with another tenant; a spinning thread on either then slows the other. The pool's client
and data threads both spin, and the judge's overhead moved 0.19-0.50 ms between runs on one host with no steal and no
preemption (docs/PERF.md, thirty-fifth session). This says whether CPUs differ and which pairs slow each other.

    python3 scripts/cpu_speed.py [--passes 2] [--pairs] [--json OUT]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=2, help="times over every CPU alone (does a CPU's speed drift?)")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--pairs", action="store_true", help="every ordered pair: CPU a timed while b spins")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
