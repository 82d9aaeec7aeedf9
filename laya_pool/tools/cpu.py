"""Where a load run's CPU goes: the cores each process of the pool and of the load generator used, and its
busiest thread's share of one core.

A Python process whose busiest thread sits near one core is what limits the run (its GIL lets one thread run at a
time); a process with cores to spare and a waiting GPU points elsewhere. `snapshot` reads the counters (psutil);
`usage` is the pure part, which tests check alone.
"""
from __future__ import annotations

import psutil

ROLES = (("laya_pool.worker", "worker"), ("laya_pool.broker", "broker"), ("laya_pool", "supervisor"))


def role(cmdline: list[str]) -> str:
    """A process's part in the run, from its command line."""
    text = " ".join(cmdline)
    for key, name in ROLES:
        if key in text:
            return name
    return "client" if "multiprocessing" in text or "spawn_main" in text else (cmdline[0] if cmdline else "?")


def _thread_name(pid: int, tid: int) -> str:
    """The OS name of a thread (the worker names its threads: worker/threadname.py); its id where unreadable."""
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return str(tid)


def snapshot(pids: dict[int, str]) -> dict[int, dict]:
    """CPU seconds so far of each process (`pids`: pid -> role) and of each of its threads (by OS name); gone ones
    are left out."""
    out = {}
    for pid, name in pids.items():
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                t = p.cpu_times()
                threads = {th.id: th.user_time + th.system_time for th in p.threads()}
            out[pid] = {"role": name, "cpu": t.user + t.system, "threads": threads,
                        "names": {tid: _thread_name(pid, tid) for tid in threads}}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def tree(root: int) -> dict[int, str]:
    """`root` and its descendants, each with its role."""
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            out[p.pid] = role(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def usage(before: dict[int, dict], after: dict[int, dict], wall: float) -> list[dict]:
    """Per process seen in both snapshots: cores used over `wall` seconds and its busiest thread's share of a core;
    busiest first."""
    rows = []
    for pid, b in before.items():
        a = after.get(pid)
        if a is None or wall <= 0:
            continue
        spent = sorted(((a["threads"][t] - b["threads"].get(t, 0.0), t) for t in a["threads"]), reverse=True)
        names = a.get("names", {})
        rows.append({"pid": pid, "role": a["role"], "cores": round((a["cpu"] - b["cpu"]) / wall, 3),
                     "busiest_thread": round(spent[0][0] / wall, 3) if spent else 0.0, "threads": len(spent),
                     "top_threads": [[names.get(t, str(t)), round(x / wall, 3)] for x, t in spent[:3]]})
    return sorted(rows, key=lambda r: -r["cores"])


def summary(rows: list[dict]) -> str:
    """One line: each role's cores (summed over its processes) and the busiest thread of each."""
    by_role: dict[str, list[dict]] = {}
    for r in rows:
        by_role.setdefault(r["role"], []).append(r)
    parts = []
    for name, rs in by_role.items():
        many = f" x{len(rs)}" if len(rs) > 1 else ""
        top = max(rs, key=lambda r: r["busiest_thread"])
        which = f"{top['top_threads'][0][0]} " if top.get("top_threads") and name != "client" else ""
        parts.append(f"{name}{many} {sum(r['cores'] for r in rs):.2f} cores "
                     f"(busiest thread {which}{top['busiest_thread']:.2f})")
    return "cpu: " + ", ".join(parts)
