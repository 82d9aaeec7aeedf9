#!/usr/bin/env python3
"""Device probe: what one kernel launch costs the host, through our wrapper, Triton's JIT dispatch, and a compiled
kernel called directly: how much of eager mode's 23.5 ms at 1x48 (326 launches, graph replay 1.27 ms) a launch
cache could take back (issue 11: eager within 3x of graph-cached).

    python3 scripts/probe_launch.py [--m 48] [--calls 2000]

One QKV-shaped GEMM (N 3,072, K 1,024, bf16, M rows) launched `--calls` times back to back, host clock around the
loop and a synchronize after it, per launch in us: `gemm()` (since the sixteenth session its plan: a key, then the
compiled kernel called directly; kernels/launch.py), `_gemm_kernel[grid](...)` (Triton's dispatch: binding,
specialization key, cache lookup, launch), the `CompiledKernel` that dispatch returned, called through its own runner
(`compiled[grid](*args)`), and `launch.Compiled` (Triton's C launcher alone, as the cache calls it). The compiled
call's output is checked bit for bit against the dispatched one.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import laya_pool.kernels.gemm as gm  # noqa: E402


def per_launch_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=48)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(args.m, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(3072, 1024, device="cuda", dtype=torch.bfloat16, generator=g) / 32
    out = torch.empty(args.m, 3072, device="cuda", dtype=torch.bfloat16)

    real = gm._gemm_kernel
    seen = {}

    class Recorder:                  # records the launch gemm() makes, then makes it
        def __getitem__(self, grid):
            def run(*a_, **kw):
                seen["grid"], seen["args"], seen["kwargs"] = grid, a_, kw
                seen["compiled"] = real[grid](*a_, **kw)
            return run
    gm._gemm_kernel = Recorder()
    try:
        gm.gemm(a, w, out)
    finally:
        gm._gemm_kernel = real
    grid, pos, kw, compiled = seen["grid"], seen["args"], seen["kwargs"], seen["compiled"]
    # The compiled kernel takes every parameter in the signature's order, constexprs included (it skips them).
    values = dict(zip(real.arg_names, pos))
    values.update({k: v for k, v in kw.items() if k in real.arg_names})
    for p in real.params:
        values.setdefault(p.name, p.default)
    flat = [values[n] for n in real.arg_names]
    runner = compiled[grid]

    want = out.clone()
    out.zero_()
    runner(*flat)
    torch.cuda.synchronize()
    same = bool(torch.equal(out, want))

    # kernels/launch.py's cached launch: the C launcher called directly (no dispatch, no tile choice, no key)
    from laya_pool.kernels import launch as ln
    entry = ln.compile_launch(real, grid, pos, kw)
    rows = {"gemm() wrapper (its plan, the default)": lambda: gm.gemm(a, w, out),
            "Triton dispatch (_gemm_kernel[grid])": lambda: real[grid](*pos, **kw),
            "compiled kernel (compiled[grid])": lambda: runner(*flat),
            "launch.Compiled (C launcher alone)": lambda: entry(grid, pos)}
    print(f"M={args.m} N=3072 K=1024, {args.calls} launches each; compiled call = dispatched bits: {same}")
    for name, fn in rows.items():
        print(f"  {name:40s} {per_launch_us(fn, args.calls):8.2f} us a launch")


if __name__ == "__main__":
    main()
