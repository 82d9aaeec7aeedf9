#!/usr/bin/env python3
"""Device probe: what a 16x512 forward cannot go under while it keeps the SDK's bits (issue 17's floor).

    python3 scripts/probe_floor.py --model /tmp/large [--shape 16x512]

In one process, graph replays (p50 / p95 ms of 40):
- ours: the fast forward, and its GPU time by kernel family in one replay (torch.profiler);
- gemms: every GEMM of the same forward (28 layers' QKV, Wo, Wi, Wo_mlp; the decision head's in, out, l1, l2) as
  cuBLAS's plain bf16 product, nothing else: the GEMMs at the speed of the fastest kernels we know in the K order the
  SDK's bits need (docs/PERF.md, "Issue 11 ends blocked": the order is cuBLAS's);
- copy: a device-to-device copy of 256 MiB, this card's bandwidth for the passes no GEMM does: the residual add +
  LayerNorm (reads the fp32 stream and the bf16 product, writes the stream and the bf16 normed row: 12 bytes a value)
  and RoPE (reads and writes each query and key value in bf16: 4 bytes); their floor at that bandwidth.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from laya_pool.kernels.fast import FastModel  # noqa: E402
from laya_pool.worker.checkpoint import load_checkpoint  # noqa: E402
from scripts.probe_fast import _family, _inputs, capture, graph_time  # noqa: E402


def families(fn) -> dict[str, float]:
    """ms of one graph replay of fn by kernel family."""
    g = capture(fn)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    out = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            f = _family(ev.name)
            if f.startswith("other"):
                cublas = any(s in ev.name for s in ("nvjet", "gemm", "sm90", "cutlass"))
                f = "cublas" if cublas else "other"
            out[f] += ev.device_time_total / 1e3
    return dict(out)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="/tmp/large")
    p.add_argument("--shape", default="16x512")
    args = p.parse_args()
    ck = load_checkpoint(args.model)
    fast = FastModel(ck.arch, ck.tensors, device="cuda", attention="triton")
    R, L = (int(x) for x in args.shape.split("x"))
    M, d = R * L, ck.arch.hidden
    inp = _inputs(ck.arch, R, L)
    fast(**inp)
    ours = graph_time(lambda: fast(**inp), reps=1, samples=40)
    fam = families(lambda: fast(**inp))

    bf = dict(device="cuda", dtype=torch.bfloat16)
    products = []
    for lay in fast.layers:
        products += [lay["Wqkv"], lay["Wo"], lay["Wi"], lay["Wo_mlp"]]
    for lay in fast.head:
        products += [lay["in_w"], lay["out_w"], lay["l1_w"], lay["l2_w"]]
    widest = max(max(w.shape) for w in products)
    a = torch.randn(M, widest, **bf)
    out = torch.empty(M, widest, **bf)

    def gemms():
        for w in products:
            n, k = w.shape
            torch.mm(a[:, :k], w.t(), out=out[:, :n])
    chain = graph_time(gemms, reps=1, samples=40)

    src = torch.empty(256 << 20, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = graph_time(lambda: dst.copy_(src), reps=4, samples=40)
    bw = 2 * src.numel() / (copy[0] / 1e3)                       # bytes moved a second (read + write)
    passes = 2 * len(fast.layers) * M * d * 12 + len(fast.layers) * M * 2 * d * 4
    print(f"{torch.cuda.get_device_name()}, {args.shape} (M = {M}), graph replay p50 / p95 ms")
    print(f"   ours, whole forward            {ours[0]:8.3f} / {ours[1]:.3f}")
    print("   ours by family (one replay):   " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                         sorted(fam.items(), key=lambda kv: -kv[1])))
    print(f"   cuBLAS plain products only     {chain[0]:8.3f} / {chain[1]:.3f}   ({len(products)} GEMMs)")
    print(f"   copy bandwidth                 {bw / 1e12:8.2f} TB/s; residual + LayerNorm and RoPE passes at it: "
          f"{passes / bw * 1e3:.3f} ms ({passes / 1e9:.2f} GB)")
    print(f"   floor (products + passes)      {chain[0] + passes / bw * 1e3:8.3f} (attention and the host not counted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
