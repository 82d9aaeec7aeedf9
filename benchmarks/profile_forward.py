"""Where the GPU time of one forward goes: the graph replay's time and the kernel time by family, per shape.

    python -m benchmarks.profile_forward --model /tmp/large [--shapes 1x48,32x48,16x512] [--out DIR]

For each RxN shape (R rows of N tokens, 4 markers each; 1x48 is a lone decision, 32x48 a merged group of 32 such):
`Runtime.run` graph-cached, as a worker runs it (host clock around the call, 3 warm-ups, then the median of 30
calls), and one eager forward under torch.profiler, its CUDA kernels' time summed by family (GEMMs, attention,
LayerNorm, ...): what bounds a forward, and how far the replay is above its kernels.
"""
from __future__ import annotations

import collections
import statistics
import sys
import time
from typing import Any

import numpy as np

from benchmarks.common import parser, write

FAMILIES = (("_linear_kernel", "gemm (invariant triton)"), ("gemm", "gemm (cublas)"), ("sm90", "gemm (cublas)"),
            ("cutlass", "gemm (cublas)"), ("flash", "attention"), ("fmha", "attention"), ("attention", "attention"),
            ("softmax", "softmax"), ("layer_norm", "layernorm"), ("norm", "layernorm"), ("gelu", "gelu"),
            ("copy", "copy/cast"), ("cat", "cat"), ("index", "index/gather"), ("gather", "index/gather"),
            ("elementwise", "elementwise"), ("reduce", "reduce"))


def family(kernel: str) -> str:
    name = kernel.lower()
    return next((fam for key, fam in FAMILIES if key in name), "other")


def batch(rows: int, tokens: int, rng: np.random.Generator, markers: int = 4) -> Any:
    from laya_pool.worker.batch import Batch
    return Batch.from_rows([(rng.integers(10, 1000, tokens).astype(np.int32),
                             np.arange(5, 5 + 3 * markers, 3, dtype=np.int32), i % 3) for i in range(rows)])


def kernel_time(rt: Any, b: Any) -> tuple[collections.Counter, collections.Counter]:
    """One eager forward under the profiler: ms and kernel count by family."""
    import torch
    rt.run(b)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        rt.run(b)
        torch.cuda.synchronize()
    ms, count = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            ms[family(ev.name)] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            count[family(ev.name)] += 1
    return collections.Counter({k: v / 1e3 for k, v in ms.items()}), count


def replay_ms(rt: Any, b: Any) -> float:
    for _ in range(3):
        rt.run(b)
    ts = []
    for _ in range(30):
        t = time.perf_counter()
        rt.run(b)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--shapes", default="1x48,32x48,16x512", help="RxN shapes")
    args = ap.parse_args(argv)
    from laya_pool.worker.checkpoint import load_checkpoint
    from laya_pool.worker.runtime import Runtime, RuntimeConfig
    from laya_pool.worker.workspace import Capacity
    ck = load_checkpoint(args.model)
    cap = Capacity(max_tokens=16 * 512, max_rows=64, max_markers=2048, row_markers=64)
    graphed = Runtime(ck, device="cuda", config=RuntimeConfig(mode="graph-cached", capacity=cap))
    eager = Runtime(ck, device="cuda", config=RuntimeConfig(mode="eager", capacity=cap))
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for shape in args.shapes.split(","):
        rows, tokens = (int(x) for x in shape.split("x"))
        b = batch(rows, tokens, rng)
        replay = replay_ms(graphed, b)
        ms, count = kernel_time(eager, b)
        out[shape] = {"graph_cached_ms_p50": round(replay, 4), "kernel_ms_total": round(sum(ms.values()), 4),
                      "kernels": sum(count.values()), "by_family_ms": {k: round(v, 3) for k, v in ms.most_common()},
                      "count": dict(count)}
        print(f"{shape}: graph-cached p50 {replay:.3f} ms; eager kernel time {sum(ms.values()):.3f} ms in "
              f"{sum(count.values())} kernels", flush=True)
        for k, v in ms.most_common():
            print(f"   {k:28s} {v:8.3f} ms  ({count[k]} kernels)")
    write(args.out, "profile_forward", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
