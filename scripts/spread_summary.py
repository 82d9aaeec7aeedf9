"""One line per `round_trip.py --host --json` run: its parts' p50 and the CPUs its busiest client and worker threads
ran on, with each CPU's NUMA node and L3 (lscpu -e), so runs of one pool that differ by 0.1-0.3 ms can be set against
where their threads landed (docs/PERF.md, thirty-fifth session: the judge's overhead 0.19-0.50 ms on one host).

    python3 scripts/spread_summary.py OUT/spread*.json
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def topology() -> dict[str, tuple[str, str]]:
    """CPU -> (NUMA node, L3 cache) (empty where lscpu is missing or says less)."""
    try:
        text = subprocess.run(["lscpu", "-e=CPU,NODE,CACHE"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out = {}
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 3:
            out[cols[0]] = (cols[1], cols[2].split(":")[-1])
    return out


def busiest(threads: list[dict]) -> tuple[str, str]:
    """(name, CPU) of the thread that spent most CPU per call, at the CPU it was seen on most ("-" where none)."""
    if not threads:
        return "-", "-"
    t = max(threads, key=lambda x: x["cpu_us_per_call"])
    return t["name"], (max(t["cpus"], key=t["cpus"].get) if t["cpus"] else "?")


def line(path: str, topo: dict[str, tuple[str, str]]) -> str:
    d = json.loads(Path(path).read_text())
    us = {k: v[0] for k, v in d["us"].items()}
    threads = d.get("host", {}).get("threads", {})
    placed = []
    for proc in ("client", "worker 0"):
        name, cpu = busiest(threads.get(proc, []))
        where = f"{name}@{cpu}" if name != "-" else "-"
        node, l3 = topo.get(cpu, ("?", "?"))
        placed.append(f"{proc.split()[0]} {where} (n{node}/L3 {l3})")
    parts = " ".join(f"{k.replace(' ', '_')} {v:.0f}" for k, v in us.items() if k != "worker gap")
    return f"{path.rsplit('/', 1)[-1]}: {parts}; " + ", ".join(placed)


def main(paths: list[str]) -> None:
    topo = topology()
    nodes, l3s = sorted({n for n, _ in topo.values()}), sorted({c for _, c in topo.values()})
    print(f"{len(topo)} CPUs, NUMA nodes {nodes}, L3 caches {l3s}")
    for p in paths:
        print(line(p, topo))


if __name__ == "__main__":
    main(sys.argv[1:])
