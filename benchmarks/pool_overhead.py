"""What the pool adds to a small forward: `Client.forward` of one pre-encoded 1x48 row through a pool against the
same batch run in-process.

    python -m benchmarks.pool_overhead --model /tmp/large [--frontend EP] [--out DIR]

Three loops, one after the other, each 30 warm-up calls then 300 timed back-to-back ones (host clock): `Client.ping`
(the broker answers it itself), `Client.forward` through the pool (started here on --devices unless --frontend names
one), and `Runtime.run` of the same batch graph-cached in this process. The pool's overhead is the forward's p50
less the in-process p50.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.common import add_pool, parser, percentiles, pool, write


def timed(fn: Callable[[], Any], n: int = 300, warmup: int = 30) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return percentiles(ts)


def one_row() -> list[tuple[np.ndarray, np.ndarray, int]]:
    rng = np.random.default_rng(0)
    return [(rng.integers(10, 1000, 48).astype(np.int32), np.array([5, 8, 11, 14], np.int32), 0)]


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    add_pool(ap)
    args = ap.parse_args(argv)
    from laya_pool import Client
    from laya_pool.worker.batch import Batch
    from laya_pool.worker.checkpoint import load_checkpoint
    from laya_pool.worker.runtime import Runtime, RuntimeConfig
    rows = one_row()
    out: dict[str, Any] = {}
    with pool(args.model, args.frontend, args.devices) as frontend, Client(frontend) as client:
        out["ping"] = timed(client.ping)
        out["forward via pool"] = timed(lambda: client.forward(rows))
        # (the pool still up beside it, as it is beside a decision loop)
        rt = Runtime(load_checkpoint(args.model), device="cuda", config=RuntimeConfig(mode="graph-cached"))
        b = Batch.from_rows(rows)
        out["forward in-process"] = timed(lambda: rt.run(b))
    for k, v in out.items():
        print(f"{k:20s} 1x48 p50 / p95 ms: {v['p50']:.3f} / {v['p95']:.3f}")
    out["pool adds p50"] = round(out["forward via pool"]["p50"] - out["forward in-process"]["p50"], 4)
    print(f"the pool adds {out['pool adds p50']:.3f} ms (p50)")
    write(args.out, "pool_overhead", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
