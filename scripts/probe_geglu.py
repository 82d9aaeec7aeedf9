#!/usr/bin/env python3
"""Device probe: the GeGLU GEMM with one accumulator over interleaved (input, gate) rows against two accumulators.

    python3 scripts/probe_geglu.py --model /tmp/large [--steps gemm,model]

- gemm: Wi's shape (2F, K) at M = 48, 128, 1,536, 8,192: GEGLU (two accumulators, Wi as the checkpoint holds it) and
  GEGLU_PAIRS (one accumulator, `geglu_pairs(Wi)`) must give the same bits, at the picked tiling and at each of a few
  others; then us per GEMM, graph-timed over 8 copies of the weights (each call reads its weights from memory, as in a
  forward), with cuBLAS's plain product [M, 2F] on the same shape beside.
- model: FastModel with LAYA_GEGLU=two and with the default (pairs), graph replay p50 / p95 ms at 1x48, 32x48, 4x256,
  16x512, interleaved (two rounds, opposite order), and whether the logits and act are the same bits.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from laya_pool.kernels.gemm import Epi, Tiles, geglu_pairs, gemm, pick_tiles  # noqa: E402
from laya_pool.kernels.launch import forget  # noqa: E402
from scripts.probe_fast import _inputs, capture, replay_ms  # noqa: E402

COPIES = 8


def timed(fn, samples: int = 30) -> tuple[float, float]:
    """(p50, p95) us of one call: a graph of COPIES calls (each on its own weight copy), replayed `samples` times."""
    ts = sorted(t / COPIES * 1e3 for t in replay_ms(capture(fn, COPIES), samples))
    return statistics.median(ts), ts[int(0.95 * (len(ts) - 1))]


def step_gemm(ff: int, d: int) -> None:
    torch.manual_seed(0)
    a = torch.randn(8192, d, device="cuda").bfloat16()
    ws = [(torch.randn(2 * ff, d, device="cuda") / d ** 0.5).bfloat16() for _ in range(COPIES)]
    ps = [geglu_pairs(w) for w in ws]
    print(f"== gemm: Wi ({2 * ff}, {d}), us per GEMM (p50/p95), weights cold; bits: pairs == two accumulators")
    for m in (48, 128, 1536, 8192):
        two = torch.empty(m, ff, device="cuda", dtype=torch.bfloat16)
        gemm(a[:m], ws[0], two, epi=Epi.GEGLU)
        picked = pick_tiles(m, ff, d, Epi.GEGLU_PAIRS)
        alts = [None, Tiles(picked.bm, picked.bn * 2, picked.bk, picked.warps, picked.stages),
                Tiles(picked.bm, max(16, picked.bn // 2), picked.bk, picked.warps, picked.stages),
                Tiles(picked.bm, picked.bn, picked.bk, picked.warps, picked.stages + 1)]
        if m > 512:
            alts += [Tiles(128, 256, 64, 8, 3), Tiles(128, 128, 64, 8, 4), Tiles(64, 128, 64, 4, 4),
                     Tiles(128, 128, 128, 8, 2), Tiles(256, 128, 64, 8, 3), Tiles(128, 128, 64, 4, 3)]
        row = []
        for t in alts:
            try:
                o = torch.empty(m, ff, device="cuda", dtype=torch.bfloat16)
                gemm(a[:m], ps[0], o, epi=Epi.GEGLU_PAIRS, tiles=t)
                same = bool(torch.equal(o, two))
                turn = itertools.cycle(ps)
                p50, p95 = timed(lambda m=m, o=o, t=t, turn=turn: gemm(a[:m], next(turn), o, epi=Epi.GEGLU_PAIRS,
                                                                         tiles=t))
                row.append(f"{'picked ' + str(picked) if t is None else str(t)}: {p50:.2f}/{p95:.2f} same {same}")
            except Exception as e:  # a tiling the compiler refuses (shared memory): say so, go on
                row.append(f"{t}: {repr(e)[:60]}")
        t_two = timed(lambda m=m, o=two, turn=itertools.cycle(ws): gemm(a[:m], next(turn), o, epi=Epi.GEGLU))
        ob = torch.empty(m, 2 * ff, device="cuda", dtype=torch.bfloat16)
        t_cub = timed(lambda m=m, ob=ob, turn=itertools.cycle(ws): torch.matmul(a[:m], next(turn).t(), out=ob))
        print(f"M={m:5d} two accumulators {pick_tiles(m, ff, d, Epi.GEGLU)}: {t_two[0]:.2f}/{t_two[1]:.2f}"
              f" | cuBLAS plain {t_cub[0]:.2f}/{t_cub[1]:.2f}")
        for r in row:
            print("   pairs " + r)


def step_model(model_dir: str) -> None:
    from laya_pool.kernels.fast import FastModel
    from laya_pool.worker.checkpoint import load_checkpoint
    from scripts.probe_fast import graph_time
    ck = load_checkpoint(model_dir)
    os.environ["LAYA_GEGLU"] = "two"
    two = FastModel(ck.arch, ck.tensors, device="cuda")
    os.environ.pop("LAYA_GEGLU")
    pairs = FastModel(ck.arch, ck.tensors, device="cuda")
    assert two.geglu == Epi.GEGLU and pairs.geglu == Epi.GEGLU_PAIRS
    forget()
    print("== model: graph replay ms p50/p95, two accumulators | pairs (two rounds, opposite order)")
    for R, L in ((1, 48), (32, 48), (4, 256), (16, 512)):
        inp = _inputs(ck.arch, R, L)
        l2, a2 = two(**inp)
        lp, ap = pairs(**inp)
        same = bool(torch.equal(l2, lp) and torch.equal(a2, ap))
        res = {"two": [], "pairs": []}
        for order in (("two", "pairs"), ("pairs", "two")):
            for name in order:
                model = two if name == "two" else pairs
                res[name].append(graph_time(lambda inp=inp, m=model: m(**inp), reps=1, samples=50))
        fmt = " ".join
        print(f"{R}x{L}: two {fmt(f'{p:.3f}/{q:.3f}' for p, q in res['two'])} | "
              f"pairs {fmt(f'{p:.3f}/{q:.3f}' for p, q in res['pairs'])} | same bits {same}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/large")
    ap.add_argument("--steps", default="gemm,model")
    args = ap.parse_args()
    from laya_pool.worker.checkpoint import load_checkpoint
    arch = load_checkpoint(args.model).arch
    steps = args.steps.split(",")
    if "gemm" in steps:
        step_gemm(arch.intermediate, arch.hidden)
    if "model" in steps:
        step_model(args.model)


if __name__ == "__main__":
    main()
