#!/usr/bin/env python3
"""Where a back-to-back 1x48 `Client.forward` on a lane spends its round trip, on one clock.

    python3 scripts/round_trip.py --frontend EP [--seconds 3 | --calls N] [--json FILE]

The client of this checkout against a live pool on this host whose worker takes lanes (protocol/lane.py; a CUDA
worker does by default). Every part is on `time.monotonic`, which the worker's stamps share (compute.py `_answer`):

- `client before`: the call starts -> its request goes to a route (pack, encode, the attempt's bookkeeping);
- `pickup`: -> the worker's data thread has read it (`received_at`): the route chosen, the lane written, the
  worker's look at its lanes;
- `worker`: -> the worker built the reply (`done_at`): validation, launch, the device, the answers;
- `notice`: -> the client saw the answer (the reply packed and written, the client's poll);
- `client after`: -> the call returns (read, decode, check, the result);
- `worker gap`: one reply built -> the next request read (what the worker waits on between calls).

Two hooks time the client, wrapped here by timing functions (nothing else changes): `Routes.send`, stamped as it is
called, and `Receiver._spin_lanes` (client/receiver.py), stamped when it saw the answer. A call that went another way
(a socket, a sleep on the lane) is counted in `total` only. Prints p50 / p95 in microseconds. The parts are
differences of consecutive stamps: they add up to the total, and every one is >= 0 when the stamps are where they
should be (tests/test_lane.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

# The checkout root, for laya_pool where it is not installed.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from laya_pool.client import direct  # noqa: E402
from laya_pool.client.pool import Client  # noqa: E402
from laya_pool.client.receiver import Receiver  # noqa: E402
from scripts import procview  # noqa: E402

PARTS = ("total", "client before", "pickup", "worker", "notice", "client after", "worker gap")
WARMUP = 50


@contextlib.contextmanager
def hooked(marks: dict[str, float]) -> Iterator[None]:
    """Stamp `marks["sent"]` when a request goes to a route and `marks["seen"]` when the spin saw its answer (the
    hooks are undone on leaving)."""
    send, spin = direct.Routes.send, Receiver._spin_lanes

    def timed_send(self: Any, rid: int, frames: list[Any]) -> bool:
        # Before: the worker may read the lane the moment its number is written, before `send` returns.
        marks["sent"] = time.monotonic()
        return send(self, rid, frames)

    def timed_spin(self: Any, end: float) -> Any:
        out = spin(self, end)
        if out is not None:          # (None: the spin ran out; the answer comes to a sleep, which is not timed)
            marks["seen"] = time.monotonic()
        return out

    direct.Routes.send, Receiver._spin_lanes = timed_send, timed_spin
    try:
        yield
    finally:
        direct.Routes.send, Receiver._spin_lanes = send, spin


def timed_call(client: Client, rows: list, marks: dict[str, float]) -> tuple[float, dict[str, float] | None, dict]:
    """One `forward`: its total (s), its parts (`split`) and the reply's metrics."""
    marks.clear()
    t = time.monotonic()
    res = client.forward(rows)
    end = time.monotonic()
    return end - t, split(t, end, marks, res.metrics), res.metrics


def split(start: float, end: float, marks: dict[str, float], metrics: dict[str, Any]) -> dict[str, float] | None:
    """One call's parts in seconds (None: it did not go through a lane with the worker's stamps)."""
    if "sent" not in marks or "seen" not in marks or "received_at" not in metrics or "done_at" not in metrics:
        return None
    received, done = metrics["received_at"], metrics["done_at"]
    return {"client before": marks["sent"] - start, "pickup": received - marks["sent"], "worker": done - received,
            "notice": marks["seen"] - done, "client after": end - marks["seen"]}


def measure(frontend: str, seconds: float | None = None, calls: int | None = None,
            host: bool = False, spin_ms: float | None = None) -> dict[str, Any]:
    """`host`: also what /proc says the window cost the client's, the worker's and the broker's threads and the CPUs
    they ran on (scripts/procview.py). `spin_ms`: the client's (0: it sleeps on the lane at once, so one core polls
    where two did; only `total` is split then)."""
    rng = np.random.default_rng(0)
    rows = [(rng.integers(10, 1000, 48).astype(np.int32), np.array([5, 8, 11, 14], np.int32), 0)]
    marks: dict[str, float] = {}
    samples: dict[str, list[float]] = {p: [] for p in PARTS}
    with hooked(marks), Client(frontend, spin_ms=spin_ms) as client:
        for _ in range(WARMUP):
            client.forward(rows)
        window = procview.Window(_pids(client)) if host else contextlib.nullcontext()
        with window:
            n = _calls(client, rows, marks, samples, seconds, calls)
    out = {"calls": n, "on_lanes": len(samples["pickup"]), "us": {k: _p50_p95(v) for k, v in samples.items() if v}}
    if host:
        out["host"] = window.report(n)
    return out


def _pids(client: Client) -> dict[str, int]:
    """This process, the first ready worker's and the broker's (all on this host: the lanes need it)."""
    st = client.status()
    worker = next(w for w in st["workers"] if w["state"] == "ready")
    return {"client": os.getpid(), f"worker {worker['id']}": worker["pid"], "broker": st["broker"]["pid"]}


def _calls(client: Client, rows: list, marks: dict[str, float], samples: dict[str, list[float]],
           seconds: float | None, calls: int | None) -> int:
    """Back-to-back timed calls until `seconds` or `calls`, their parts into `samples`; how many were made."""
    stop = time.monotonic() + (seconds if seconds is not None else 1e9)
    n, last_done = 0, None
    while time.monotonic() < stop and (calls is None or n < calls):
        total, parts, metrics = timed_call(client, rows, marks)
        n += 1
        samples["total"].append(total)
        if parts is None:
            last_done = None
            continue
        for k, v in parts.items():
            samples[k].append(v)
        if last_done is not None:
            samples["worker gap"].append(metrics["received_at"] - last_done)
        last_done = metrics["done_at"]
    return n


def _p50_p95(values: list[float]) -> tuple[float, float]:
    v = sorted(values)
    return round(v[len(v) // 2] * 1e6, 1), round(v[int(0.95 * (len(v) - 1))] * 1e6, 1)


def print_host(h: dict[str, Any]) -> None:
    print(f"per call, {h['calls']} calls in {h['seconds']} s: CPU us, voluntary / involuntary switches, CPUs seen on")
    for name, rows in h["threads"].items():
        for r in rows:
            cpus = ", ".join(f"{c}:{n}" for c, n in list(r["cpus"].items())[:4])
            print(f"{name:10s} {r['tid']:>8d} {r['name'][:15]:15s} {r['cpu_us_per_call']:8.1f} "
                  f"{r['voluntary_per_call']:7.3f} {r['involuntary_per_call']:7.3f}  [{cpus}]")
    print(f"CPU  busy%  steal%     MHz   (steal over all CPUs: {h['steal_pct_all']:.2f}%)")
    for c, v in h["cpus"].items():
        print(f"{c:>3} {v['busy_pct']:6.1f} {v['steal_pct']:7.1f} {v.get('mhz', 0):7.0f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frontend", required=True)
    ap.add_argument("--seconds", type=float, default=None, help="back-to-back calls for this long (default 3 s)")
    ap.add_argument("--calls", type=int, default=None, help="... or this many")
    ap.add_argument("--host", action="store_true",
                    help="also the window's cost to each process's busiest threads and their CPUs' steal (/proc)")
    ap.add_argument("--spin-ms", type=float, default=None,
                    help="the client's spin_ms (default: its own choice; 0: it sleeps on the lane at once)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    out = measure(a.frontend, a.seconds if a.seconds is not None or a.calls is not None else 3.0, a.calls, a.host,
                  a.spin_ms)
    print(f"{out['calls']} calls, {out['on_lanes']} on lanes; us p50 / p95")
    for k, (p50, p95) in out["us"].items():
        print(f"{k:14s} {p50:8.1f} {p95:8.1f}")
    if a.host:
        print_host(out["host"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
