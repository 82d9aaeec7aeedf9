"""What the kernel says a run cost each thread and each CPU: for scripts/round_trip.py's `--host`.

The question it answers (docs/PERF.md, thirty-first session): on some device hosts the worker's part of a pooled call
is ~170 us longer than the same forward in-process, and the client's parts take twice the time they take on other
hosts. Three causes look the same from inside Python: a vCPU the hypervisor took away (steal), a thread preempted by
another on its core (involuntary switches), and a thread that moved between cores (cold caches). /proc tells them
apart; this reads it before and after a window and per call:

- every thread of a process: CPU time, voluntary and involuntary context switches, and the CPUs it was seen on
  (sampled while the window runs: `Sampler`);
- every CPU: its busy, idle and steal time.

Linux only. Pure parsing apart from the reads, so the parsing is tested alone (tests/test_procview.py).
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ThreadStat:
    cpu_s: float          # user + system
    voluntary: int        # context switches it asked for (a sleep, a blocking read)
    involuntary: int      # ... it was made to take (preempted)
    processor: int        # the CPU it last ran on
    name: str = ""        # its name (the worker names its threads: "compute" is the data thread)


def parse_thread(stat: str, status: str) -> ThreadStat:
    """A thread's /proc/PID/task/TID/stat and .../status texts."""
    # The command name (field 2) is in parentheses and may hold spaces: count fields after its closing one.
    rest = stat[stat.rindex(")") + 2:].split()
    utime, stime, processor = int(rest[11]), int(rest[12]), int(rest[36])      # fields 14, 15 and 39
    switches = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            switches[key] = int(value)
    return ThreadStat((utime + stime) * TICK_S, switches["voluntary_ctxt_switches"],
                      switches["nonvoluntary_ctxt_switches"], processor, stat[stat.index("(") + 1:stat.rindex(")")])


def parse_cpus(text: str) -> dict[int, tuple[int, int, int]]:
    """/proc/stat's per-CPU lines: {cpu: (busy, idle, steal)} in ticks (busy counts neither idle nor steal)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *values = line.split()
            v = [int(x) for x in values] + [0] * 8
            user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
            out[int(name[3:])] = (user + nice + system + irq + softirq, idle + iowait, steal)
    return out


def parse_mhz(text: str) -> dict[int, float]:
    """/proc/cpuinfo: {cpu: its clock now, MHz} (a VM often shows one fixed number; a host with frequency scaling
    shows a busy core's turbo, which more busy cores may lower)."""
    out, cpu = {}, None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            cpu = int(value)
        elif key == "cpu MHz" and cpu is not None:
            out[cpu] = float(value)
    return out


def read_threads(pid: int) -> dict[int, ThreadStat]:
    """Every thread of `pid` now (a thread that ends while it is read is left out)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = parse_thread((task / "stat").read_text(), (task / "status").read_text())
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def read_cpus() -> dict[int, tuple[int, int, int]]:
    return parse_cpus(Path("/proc/stat").read_text())


class Sampler:
    """While it runs, which CPU each thread of the watched processes is on, every `every_s`: `seen[(pid, tid)]` is
    {cpu: samples}. It samples from a process of its own: a thread in the measured client would change the client
    (one with other threads does not spin on its lanes, client/state.py `alone`)."""

    def __init__(self, pids: list[int], every_s: float = 0.02):
        self.pids, self.every_s = pids, every_s
        self.seen: dict[tuple[int, int], dict[int, int]] = {}

    def __enter__(self) -> Sampler:
        self._child = subprocess.Popen([sys.executable, __file__, str(self.every_s), *map(str, self.pids)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self._child.communicate("", timeout=30)      # its stdin closed: it prints what it saw and ends
        for pid, tid, cpu, n in json.loads(out):
            self.seen.setdefault((pid, tid), {})[cpu] = n


def _sample(every_s: float, pids: list[int]) -> None:
    """The sampler's process: sample until stdin closes, then print [[pid, tid, cpu, samples], ...] as JSON."""
    seen: dict[tuple[int, int, int], int] = {}
    while not select.select([sys.stdin], [], [], every_s)[0]:
        for pid in pids:
            try:
                threads = read_threads(pid)
            except FileNotFoundError:
                continue
            for tid, t in threads.items():
                seen[(pid, tid, t.processor)] = seen.get((pid, tid, t.processor), 0) + 1
    print(json.dumps([[*k, n] for k, n in seen.items()]))


def thread_report(before: dict[int, ThreadStat], after: dict[int, ThreadStat], calls: int,
                  seen: dict[int, dict[int, int]]) -> list[dict]:
    """Each thread's share of the window, busiest first: per call, its CPU (us) and context switches; the CPUs it
    was seen on (with how often)."""
    rows = []
    for tid, a in after.items():
        b = before.get(tid)
        if b is None:
            continue
        rows.append({"tid": tid, "name": a.name, "cpu_us_per_call": round((a.cpu_s - b.cpu_s) / calls * 1e6, 1),
                     "voluntary_per_call": round((a.voluntary - b.voluntary) / calls, 3),
                     "involuntary_per_call": round((a.involuntary - b.involuntary) / calls, 3),
                     "cpus": dict(sorted(seen.get(tid, {}).items(), key=lambda kv: -kv[1]))})
    return sorted(rows, key=lambda r: -r["cpu_us_per_call"])


def cpu_report(before: dict[int, tuple[int, int, int]], after: dict[int, tuple[int, int, int]]) -> dict[int, dict]:
    """Each CPU's busy and steal share of the window, in percent of its ticks."""
    out = {}
    for cpu, (busy, idle, steal) in after.items():
        b = before.get(cpu)
        if b is None:
            continue
        d = [x - y for x, y in zip((busy, idle, steal), b)]
        total = sum(d) or 1
        out[cpu] = {"busy_pct": round(100 * d[0] / total, 1), "steal_pct": round(100 * d[2] / total, 1)}
    return out


class Window:
    """Before/after readings of processes' threads and of the CPUs around a timed window."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids                          # {"client": pid, "worker": pid, ...}
        self.sampler = Sampler(list(pids.values()))

    def __enter__(self) -> Window:
        self.t0 = time.monotonic()
        self.cpus0 = read_cpus()
        self.threads0 = {name: read_threads(pid) for name, pid in self.pids.items()}
        self.sampler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        # The readings first, the sampler's shutdown (a process's exit) after: it is not part of the window.
        self.seconds = time.monotonic() - self.t0
        self.cpus1 = read_cpus()
        self.threads1 = {name: read_threads(pid) for name, pid in self.pids.items()}
        self.mhz = parse_mhz(Path("/proc/cpuinfo").read_text())      # as the window ends (the cores still busy)
        self.sampler.__exit__()

    def report(self, calls: int, top: int = 3) -> dict:
        """Per process its `top` busiest threads; the CPUs those threads were seen on, with their steal."""
        out: dict = {"seconds": round(self.seconds, 2), "calls": calls, "threads": {}}
        used: set[int] = set()
        for name, pid in self.pids.items():
            seen = {tid: cpus for (p, tid), cpus in self.sampler.seen.items() if p == pid}
            rows = thread_report(self.threads0[name], self.threads1[name], max(calls, 1), seen)[:top]
            out["threads"][name] = rows
            for r in rows:
                used.update(r["cpus"])
        cpus = cpu_report(self.cpus0, self.cpus1)
        for c, mhz in self.mhz.items():
            if c in cpus:
                cpus[c]["mhz"] = mhz
        out["cpus"] = {c: cpus[c] for c in sorted(used) if c in cpus}
        out["steal_pct_all"] = round(sum(c["steal_pct"] for c in cpus.values()) / max(len(cpus), 1), 2)
        return out


if __name__ == "__main__":
    _sample(float(sys.argv[1]), [int(x) for x in sys.argv[2:]])
