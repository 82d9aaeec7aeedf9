"""Where a back-to-back 1x48 `Client.forward` on a lane spends its round trip, on one clock.

    python -m benchmarks.round_trip [--frontend EP | --model DIR] [--seconds 3 | --calls N] [--spin-ms MS] [--out DIR]

The client of this checkout against a pool on this host (started here on --devices unless --frontend names one)
whose worker takes lanes (protocol/lane.py; a CUDA worker does by default). Every part is on `time.monotonic`, which
the worker's stamps share (compute.py `_answer`):

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

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from benchmarks.common import add_pool, parser, pool, write
from laya_pool.client import direct
from laya_pool.client.pool import Client
from laya_pool.client.receiver import Receiver

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
            spin_ms: float | None = None) -> dict[str, Any]:
    """`spin_ms`: the client's (0: it sleeps on the lane at once, so one core polls where two did; only `total` is
    split then)."""
    rng = np.random.default_rng(0)
    rows = [(rng.integers(10, 1000, 48).astype(np.int32), np.array([5, 8, 11, 14], np.int32), 0)]
    marks: dict[str, float] = {}
    samples: dict[str, list[float]] = {p: [] for p in PARTS}
    with hooked(marks), Client(frontend, spin_ms=spin_ms) as client:
        for _ in range(WARMUP):
            client.forward(rows)
        n = _calls(client, rows, marks, samples, seconds, calls)
    return {"calls": n, "on_lanes": len(samples["pickup"]), "us": {k: _p50_p95(v) for k, v in samples.items() if v}}


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


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    add_pool(ap, model=False)
    ap.add_argument("--model", help="the checkpoint of the pool this starts (without --frontend)")
    ap.add_argument("--seconds", type=float, default=None, help="back-to-back calls for this long (default 3 s)")
    ap.add_argument("--calls", type=int, default=None, help="... or this many")
    ap.add_argument("--spin-ms", type=float, default=None,
                    help="the client's spin_ms (default: its own choice; 0: it sleeps on the lane at once)")
    a = ap.parse_args(argv)
    if not a.frontend and not a.model:
        ap.error("give --model (a pool is started) or --frontend (a running pool on this host)")
    with pool(a.model, a.frontend, a.devices) as frontend:
        out = measure(frontend, a.seconds if a.seconds is not None or a.calls is not None else 3.0, a.calls,
                      a.spin_ms)
    print(f"{out['calls']} calls, {out['on_lanes']} on lanes; us p50 / p95")
    for k, (p50, p95) in out["us"].items():
        print(f"{k:14s} {p50:8.1f} {p95:8.1f}")
    write(a.out, "round_trip", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
