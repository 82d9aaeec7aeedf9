#!/usr/bin/env python3
"""Device probe: what one output tile's K chain costs at small M, and whether anything but that chain bounds a GEMM.

Batch invariance and SDK parity fix each output element's reduction: one chain of tensor-core steps from zero, K
ascending (cuBLAS's order at the M the SDK runs; kernels/gemm.py). At M <= 64 a GEMM has one row of output tiles, so
its time is at least one program's chain. This probe times our GEMM (kernels/gemm.py, plain epilogue, tiles forced)
at M = 48 against K, for the tile widths the fast path picks at small M, with one program and with a full wave:

- `one`: N = BN, one program: the chain alone (its weights are one tile column, in L2 after the first replay);
- `wave`: N = BN x SMs, one program per SM: the same chain on every SM, with the weights streaming from memory (a
  different weight copy each call, so no replay finds them in L2);
- cuBLAS (`torch.mm`) on the `wave` shapes, for scale.

Each time is graph-timed as a worker runs a forward: 20 calls a graph under PDL (kernels/launch.py), median of 30
replays. A least-squares line over K gives each tiling's fixed cost and its cost per 1,024 of K; then the encoder's
four GEMMs at M = 48 (their picked tiles, `pick_tiles` / `fill_tiles`) get a chain floor from the line, summed over
the layers: what a forward at 1x48 cannot go under while each dot product stays one chain of this kind.

    python3 scripts/probe_chain.py [--model /tmp/large] [--out DIR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

import torch

# The checkout root, for laya_pool where it is not installed.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import probe_fast  # noqa: E402  (beside this script)

from laya_pool.kernels.gemm import Epi, Tiles, fill_tiles, gemm, pick_tiles  # noqa: E402
from laya_pool.kernels.launch import sms  # noqa: E402

M = 48
KS = (256, 512, 1024, 2048, 4096)
TILINGS = (Tiles(64, 16, 128, 4, 4), Tiles(64, 32, 128, 4, 4), Tiles(64, 64, 128, 4, 4), Tiles(64, 16, 64, 4, 4))
COPIES = 8                  # weight copies cycled through in `wave` (each call reads memory, not L2)
REPS = 20


def graph_time(fns: list) -> float:
    """Median ms of one call, cycling through `fns` (probe_fast's graph timing: REPS calls a graph)."""
    turn = itertools.cycle(fns)
    return probe_fast.graph_time(lambda: next(turn)(), reps=REPS)[0]


def calls(n: int, k: int, copies: int, tiles: Tiles | None) -> tuple[list, list]:
    """(ours, cuBLAS): one call per weight copy, [M, k] x [n, k]^T -> [M, n] bf16."""
    a = torch.randn(M, k, device="cuda").bfloat16()
    ws = [(torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16() for _ in range(copies)]
    out = torch.empty(M, n, device="cuda", dtype=torch.bfloat16)
    ours = [lambda w=w: gemm(a, w, out, epi=Epi.PLAIN, tiles=tiles) for w in ws]
    theirs = [lambda w=w: torch.mm(a, w.t(), out=out) for w in ws]
    return ours, theirs


def line(ks, us) -> tuple[float, float]:
    """Least squares us = fixed + per_k * K / 1024."""
    xs = [k / 1024 for k in ks]
    mx, my = statistics.fmean(xs), statistics.fmean(us)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, us)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def encoder_gemms(model: str | None) -> tuple[int, list[tuple[str, int, int, Epi]]]:
    """(layers, [(name, n_out, k, epi)]) of the large preset, or of `model`'s arch when given."""
    layers, d, ff = 28, 1024, 2624
    if model:
        from laya_pool.worker.checkpoint import load_checkpoint
        arch = load_checkpoint(model, with_tensors=False).arch
        layers, d, ff = arch.layers, arch.hidden, arch.intermediate
    return layers, [("qkv", 3 * d, d, Epi.ROPE), ("wo", d, d, Epi.RESIDUAL), ("wi", 2 * ff, d, Epi.GEGLU_PAIRS),
                    ("wo_mlp", d, ff, Epi.RESIDUAL)]


def picked(n_out: int, k: int, epi: Epi, count: int) -> Tiles:
    t = pick_tiles(M, n_out, k, epi, count)
    return fill_tiles(t, M, n_out, count) if epi == Epi.RESIDUAL else t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint whose arch sizes the floor (default: the large preset)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    torch.manual_seed(0)
    count = sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, {count} SMs; M = {M}; us a call (graph-timed, {REPS} calls a graph)")
    report: dict = {"device": torch.cuda.get_device_name(), "sms": count, "m": M, "tilings": {}}
    print("| tiling | K | one program | one wave (weights from memory) | cuBLAS, same wave |")
    print("| --- | --- | --- | --- | --- |")
    for t in TILINGS:
        rows = []
        for k in KS:
            ours1, _ = calls(t.bn, k, 1, t)
            oursw, cublas = calls(t.bn * count, k, COPIES, t)
            one, wave, cub = graph_time(ours1) * 1e3, graph_time(oursw) * 1e3, graph_time(cublas) * 1e3
            rows.append({"k": k, "one": one, "wave": wave, "cublas": cub})
            print(f"| {t.bm}x{t.bn}x{t.bk} | {k} | {one:.2f} | {wave:.2f} | {cub:.2f} |")
        fixed, per_k = line([r["k"] for r in rows], [r["one"] for r in rows])
        wfixed, wper_k = line([r["k"] for r in rows], [r["wave"] for r in rows])
        report["tilings"][f"{t.bn}x{t.bk}"] = {"rows": rows, "one": [fixed, per_k], "wave": [wfixed, wper_k]}
        print(f"  line, one program: {fixed:.2f} us + {per_k:.2f} us per 1,024 of K ({per_k / 64 * 1e3:.1f} ns a "
              f"16-step); one wave: {wfixed:.2f} + {wper_k:.2f}")
    layers, gemms = encoder_gemms(a.model)
    total = 0.0
    print(f"\nChain floor of the encoder's GEMMs at M = {M} (picked tiles; the `one` line of the same BN and BK, or "
          "the nearest measured):")
    floor = {}
    for name, n_out, k, epi in gemms:
        t = picked(n_out, k, epi, count)
        key = f"{t.bn}x{t.bk}" if f"{t.bn}x{t.bk}" in report["tilings"] else f"{min(t.bn, 64)}x128"
        fixed, per_k = report["tilings"].get(key, report["tilings"]["64x128"])["one"]
        us = fixed + per_k * k / 1024
        floor[name] = {"tiles": [t.bm, t.bn, t.bk], "us": us}
        total += us
        print(f"  {name}: tiles {t.bm}x{t.bn}x{t.bk}, K {k}: {us:.2f} us")
    report["floor_per_layer_us"], report["floor_forward_ms"] = total, total * layers / 1e3
    report["floor"] = floor
    print(f"  per layer {total:.2f} us; x {layers} layers: {total * layers / 1e3:.3f} ms of GEMM chains a forward")
    with open(os.path.join(a.out, "probe_chain.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
