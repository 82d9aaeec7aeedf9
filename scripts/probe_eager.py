#!/usr/bin/env python3
"""Device probe: eager mode against graph replay (issue 11: eager within 3x of graph-cached at 1x48), and where an
eager forward's host time goes.

    python3 scripts/probe_eager.py --model /tmp/large [--shapes 1x48,4x256] [--samples 30] [--profile]

Per shape: an eager forward's host time (host clock around the call and a synchronize, p50 / p95 of `--samples`
after 5 warm-ups), the same forward's graph replay (CUDA events), their ratio, and whether eager with the launch
cache (kernels/launch.py, `LAYA_LAUNCH_CACHE`) gives the same bits as without it and as the replay. `--profile`:
cProfile of 10 eager forwards of the first shape, the 25 functions with the most own time.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]

from probe_fast import _inputs, graph_time  # noqa: E402


def eager_ms(fn, samples: int) -> tuple[float, float]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(samples):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return statistics.median(ts), ts[int(0.95 * (len(ts) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--shapes", default="1x48,4x256")
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    from laya_pool.kernels.fast import FastModel
    from laya_pool.worker.checkpoint import load_checkpoint
    ck = load_checkpoint(args.model)
    fast = FastModel(ck.arch, ck.tensors, device="cuda", attention="triton")
    print(f"== eager against graph replay (LAYA_LAUNCH_CACHE={os.environ.get('LAYA_LAUNCH_CACHE', 'default')})")
    first = None
    for shape in args.shapes.split(","):
        r, length = (int(x) for x in shape.split("x"))
        inp = _inputs(ck.arch, r, length)
        first = first or inp
        fast(**inp)                       # every launch of its kind once (through Triton's dispatch)
        logits, act = fast(**inp)         # every launch from the cache
        e50, e95 = eager_ms(lambda inp=inp: fast(**inp), args.samples)
        asked = os.environ.get("LAYA_LAUNCH_CACHE")
        os.environ["LAYA_LAUNCH_CACHE"] = "0"
        try:
            lo, ao = fast(**inp)
            off50, off95 = eager_ms(lambda inp=inp: fast(**inp), args.samples)
            same_eager = bool(torch.equal(lo, logits) and torch.equal(ao, act))
        finally:
            if asked is None:
                os.environ.pop("LAYA_LAUNCH_CACHE")
            else:
                os.environ["LAYA_LAUNCH_CACHE"] = asked
        g50, g95 = graph_time(lambda inp=inp: fast(**inp), reps=1, samples=50)
        print(f"{shape:>7}: eager {e50:.3f} / {e95:.3f} ms (cache off {off50:.3f} / {off95:.3f}), graph replay "
              f"{g50:.3f} / {g95:.3f}: eager / replay {e50 / g50:.2f}x (cache off {off50 / g50:.2f}x); "
              f"cache on = off bits: {same_eager}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            fast(**first)
        torch.cuda.synchronize()
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
