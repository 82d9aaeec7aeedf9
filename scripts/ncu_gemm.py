#!/usr/bin/env python3
"""Device probe: where a small-M GEMM's time goes (issue 11), for Nsight Compute to read.

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        -k regex:_gemm_kernel --launch-skip 3 --launch-count 4 python3 scripts/ncu_gemm.py [--m 48]

Runs the four encoder GEMMs of the large preset (QKV + RoPE, Wo + residual, Wi + GeGLU, Wo_mlp + residual) at one M
with the tiles `pick_tiles` picks, twice: the first round compiles, so `--launch-skip 4 --launch-count 4` profiles
the second (ncu flushes the caches before each profiled kernel: weights come from memory, as in a forward).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from laya_pool.kernels.gemm import Epi, gemm, residual, rope_pairs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=48)
    m = ap.parse_args().m
    torch.manual_seed(0)
    dev, d, ff, hd = "cuda", 1024, 2624, 64
    x = torch.randn(m, max(d, ff), device=dev).bfloat16()
    h = torch.randn(m, d, device=dev)
    w_qkv = rope_pairs((torch.randn(3 * d, d, device=dev) / 32).bfloat16(), hd)
    w_o = (torch.randn(d, d, device=dev) / 32).bfloat16()
    w_i = (torch.randn(2 * ff, d, device=dev) / 32).bfloat16()
    w_mlp = (torch.randn(d, ff, device=dev) / 51).bfloat16()
    pos = torch.arange(m, device=dev, dtype=torch.int32) % 512
    cos, sin = torch.rand(8192, hd // 2, device=dev), torch.rand(8192, hd // 2, device=dev)
    qkv = torch.empty(m, 3 * d, device=dev, dtype=torch.bfloat16)
    mid = torch.empty(m, ff, device=dev, dtype=torch.bfloat16)
    for _ in range(2):      # the first round compiles; ncu skips it
        gemm(x[:, :d], w_qkv, qkv, epi=Epi.ROPE, rope=(pos, cos, sin, hd, 32))
        residual(x[:, :d], w_o, h, None)
        gemm(x[:, :d], w_i, mid, epi=Epi.GEGLU_PAIRS)      # the forward's form (random w: its order is moot)
        residual(x[:, :ff], w_mlp, h, None)
    torch.cuda.synchronize()
    print("done", m)


if __name__ == "__main__":
    main()
