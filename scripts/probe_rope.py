#!/usr/bin/env python3
"""Device probe: where RoPE runs after cuBLAS's QKV product (kernels/fast.py `ROPE_AT`).

    python3 scripts/probe_rope.py --model /tmp/large [--shapes 32x48,4x256,16x512] [--rounds 2]

One FastModel; for each shape the three places ("apart": a rotation kernel for queries and keys, "queries": the
attention kernel rotates the queries as it loads them, "attention": it rotates the keys too) in interleaved rounds,
each a graph replay p50 / p95 ms, whether the logits and act are the bits of "apart" and of our GEMMs alone
(LAYA_CUBLAS=0, where our QKV GEMM rotates in its epilogue), and the GPU time of the attention and rotation kernels in
one replay (torch.profiler, us summed over the forward's kernels of that name).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from laya_pool.kernels.fast import ROPE_AT, FastModel  # noqa: E402
from laya_pool.worker.checkpoint import load_checkpoint  # noqa: E402

from scripts.probe_fast import _inputs, capture, graph_time  # noqa: E402


def kernel_us(fn) -> dict[str, float]:
    """us of one graph replay of fn, summed by kernel (attention, rope, and everything else)."""
    g = capture(fn)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    out = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = "attention" if "_attention_kernel" in ev.name else "rope" if "_rope_kernel" in ev.name else "rest"
            out[name] += ev.device_time_total
    return dict(out)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="/tmp/large")
    p.add_argument("--shapes", default="32x48,4x256,16x512")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    ck = load_checkpoint(args.model)
    fast = FastModel(ck.arch, ck.tensors, device="cuda", attention="triton")
    os.environ["LAYA_CUBLAS"] = "0"
    ours = FastModel(ck.arch, ck.tensors, device="cuda", attention="triton")
    os.environ.pop("LAYA_CUBLAS")
    print(f"{torch.cuda.get_device_name()}; graph replay p50 / p95 ms; same bits as 'apart' / as our GEMMs alone")
    for shape in args.shapes.split(","):
        R, L = (int(x) for x in shape.split("x"))
        inp = _inputs(ck.arch, R, L)
        alone = [t.clone() for t in ours(**inp)]
        answers, times = {}, collections.defaultdict(list)
        for r in range(args.rounds):
            for at in (ROPE_AT if r % 2 == 0 else ROPE_AT[::-1]):
                fast.rope_at = at
                answers[at] = [t.clone() for t in fast(**inp)]
                times[at].append(graph_time(lambda inp=inp: fast(**inp), reps=1, samples=40))
        print(f"\n== {shape} (M = {R * L}): proofs {fast.products.proofs.summary()}")
        for at in ROPE_AT:
            fast.rope_at = at
            same = all(torch.equal(a, b) for a, b in zip(answers[at], answers["apart"]))
            mine = all(torch.equal(a, b) for a, b in zip(answers[at], alone))
            us = kernel_us(lambda inp=inp: fast(**inp))
            rounds = "  ".join(f"{m:.3f} / {q:.3f}" for m, q in times[at])
            print(f"   {at:9s} {rounds}   same bits {same} / {mine}   attention {us.get('attention', 0):8.1f} us, "
                  f"rope {us.get('rope', 0):7.1f} us, rest {us.get('rest', 0):9.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
