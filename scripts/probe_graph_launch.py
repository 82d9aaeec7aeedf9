#!/usr/bin/env python3
"""Device probe: a captured graph launched through torch (CUDAGraph.replay in the stream's context) against
cudaGraphLaunch called directly (LAYA_GRAPH_LAUNCH=direct), same process, same checkpoint, interleaved.

    python3 scripts/probe_graph_launch.py --model /tmp/large [--calls 2000] [--shapes 1x48,32x48,4x256]

For each shape and launch: `Runtime.launch`'s own host time (validation skipped as the worker skips it; plan, pack,
upload, launch, readback queued), `Runtime.run`'s whole time, p50 / p95 us, and whether the answers are equal.
Prediction (docs/PERF.md, twenty-fifth session): ~10 us less host time a launch on the development CPU's scale,
25-40 us on a device host; the same bits.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# The checkout root, for laya_pool where it is not installed.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from laya_pool.worker.batch import Batch  # noqa: E402
from laya_pool.worker.checkpoint import load_checkpoint  # noqa: E402
from laya_pool.worker.runtime import Runtime, RuntimeConfig  # noqa: E402
from laya_pool.worker.workspace import Capacity  # noqa: E402

CAP = Capacity(max_tokens=16 * 512, max_rows=32, max_markers=1024, row_markers=64)


def batch_of(rows: int, length: int, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    return Batch.from_rows([(rng.integers(5, 1000, length).astype(np.int32),
                             np.sort(rng.choice(np.arange(1, length), 4, replace=False)).astype(np.int32),
                             int(rng.integers(0, 3))) for _ in range(rows)])


def percentiles(xs: list[float]) -> str:
    s = sorted(xs)
    return f"{statistics.median(s):8.1f} / {s[int(0.95 * (len(s) - 1))]:8.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--shapes", default="1x48,32x48,4x256")
    a = ap.parse_args()
    ck = load_checkpoint(a.model)
    rts = {}
    for how in ("torch", "direct"):
        os.environ["LAYA_GRAPH_LAUNCH"] = how
        rts[how] = Runtime(ck, device="cuda", config=RuntimeConfig(mode="graph-cached", capacity=CAP))
        rts[how].warmup()
    print(f"{'shape':8s} {'launch':7s} {'launch host us p50 / p95':>26s} {'run us p50 / p95':>20s}  same bits")
    for spec in a.shapes.split(","):
        rows, length = (int(x) for x in spec.split("x"))
        batches = [batch_of(rows, length, seed) for seed in range(4)]
        host: dict[str, list[float]] = {k: [] for k in rts}
        whole: dict[str, list[float]] = {k: [] for k in rts}
        answers: dict[str, list] = {k: [] for k in rts}
        for i in range(a.calls + 100):
            for how in (("torch", "direct") if i % 2 else ("direct", "torch")):
                rt, b = rts[how], batches[i % len(batches)]
                t0 = time.perf_counter()
                job = rt.launch(b, checked=True)
                t1 = time.perf_counter()
                res = rt.finish(job)
                t2 = time.perf_counter()
                if i >= 100:
                    host[how].append((t1 - t0) * 1e6)
                    whole[how].append((t2 - t0) * 1e6)
                if i < len(batches):
                    answers[how].append((res.logits.copy(), res.act.copy()))
        same = all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])
                   for x, y in zip(answers["torch"], answers["direct"]))
        for how in rts:
            print(f"{spec:8s} {how:7s} {percentiles(host[how]):>26s} {percentiles(whole[how]):>20s}  {same}")
    print("direct launches:", rts["direct"].direct_launches, "torch:", rts["torch"].direct_launches)


if __name__ == "__main__":
    main()
