#!/usr/bin/env python3
"""Device probe for the fast path (kernels/fast.py): invariance, accuracy and speed of its parts and of the whole.

    python3 scripts/probe_fast.py --model /tmp/large [--steps gemm,attention,model] [--out DIR]

- gemm: every GEMM of the checkpoint (its N, K and epilogue) at every tile configuration this probe knows,
  on one input of 8,192 rows: all configurations must give the same bits, and so must the configuration
  `pick_tiles` chooses for every prefix M (the buckets a worker runs). Then time per (GEMM, M): the picked
  tiles, the alternatives, and cuBLAS on the same shapes (CUDA-graph replays, median and p95).
- attention: packed banded/global attention against a per-row SDPA with an explicit mask (fp32 math on the
  same bf16 inputs); a row's output must not change when other rows are packed around it; time per layer kind.
- model: FastModel against the bf16 reference forward (the previous production path) and fp32; graph replay
  time per shape (median / p95 of 50 replays after 10 warm-ups); kernel count and time by family of one forward.
Prints a table per step; writes probe_fast.json under --out.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

# The checkout root, for laya_pool where it is not installed.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from laya_pool.kernels import rows as rk  # noqa: E402
from laya_pool.kernels.gemm import Act, Epi, Tiles, gemm, k_chunk, pick_tiles, residual  # noqa: E402
from laya_pool.kernels.launch import forget  # noqa: E402

ALT = [Tiles(64, 16, 64, 4, 4), Tiles(64, 32, 128, 4, 4), Tiles(64, 64, 64, 4, 3), Tiles(64, 128, 64, 4, 3),
       Tiles(128, 64, 64, 8, 3), Tiles(128, 128, 64, 8, 3), Tiles(128, 128, 128, 8, 2), Tiles(128, 256, 64, 8, 3)]
MS = (48, 64, 128, 256, 512, 1024, 1536, 2048, 4096, 8192)
TIMED_MS = (48, 1536, 8192)
GEGLUS = (Epi.GEGLU, Epi.GEGLU_PAIRS)      # [input; gate] in two accumulators, or interleaved in one


def capture(fn, reps: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `reps` calls of fn (three warm-up calls on a side stream first), replayed three times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(reps):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    return g


def replay_ms(g: torch.cuda.CUDAGraph, samples: int) -> list[float]:
    """ms of each of `samples` replays of g, by CUDA events around each."""
    ts = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return ts


def graph_time(fn, reps: int = 20, samples: int = 30) -> tuple[float, float]:
    """(median, p95) ms of one call, from CUDA-graph replays of `reps` calls (launch gaps as in a worker)."""
    ts = sorted(t / reps for t in replay_ms(capture(fn, reps), samples))
    return statistics.median(ts), ts[int(0.95 * (len(ts) - 1))]


def gemm_cases(arch):
    d, ff = arch.hidden, arch.intermediate
    return {"qkv+rope": (3 * d, d, Epi.ROPE, {}), "wo+res": (d, d, Epi.RESIDUAL, {}),
            "wi+geglu": (2 * ff, d, Epi.GEGLU_PAIRS, {}), "wo_mlp+res": (d, ff, Epi.RESIDUAL, {}),
            "head.in+bias": (3 * d, d, Epi.PLAIN, {"bias": True, "bias_apart": True}),
            "head.l1+relu": (4 * d, d, Epi.PLAIN, {"bias": True, "act": Act.RELU}),
            "head.l2+res": (d, 4 * d, Epi.RESIDUAL, {"bias": True})}


def step_gemm(arch, report):
    torch.manual_seed(0)
    dev = "cuda"
    D = arch.head_dim
    pos = torch.randint(0, arch.max_len, (8192,), device=dev, dtype=torch.int32)
    cos = torch.rand(arch.max_len, D // 2, device=dev)
    sin = torch.rand(arch.max_len, D // 2, device=dev)
    print("\n== gemm: invariance (bits equal across tiles and M) and time (ms p50/p95; GB/s of weights; TFLOP/s)")
    report["gemm"] = {name: _gemm_case(name, n, k, epi, kw, arch, pos, cos, sin)
                      for name, (n, k, epi, kw) in gemm_cases(arch).items()}


def _gemm_case(name, n, k, epi, kw, arch, pos, cos, sin):
    dev, D = "cuda", arch.head_dim
    a = torch.randn(8192, k, device=dev).bfloat16()
    w = (torch.randn(n, k, device=dev) / k ** 0.5).bfloat16()
    bias = torch.randn(n, device=dev).bfloat16() if kw.get("bias") else None
    n_out = n // 2 if epi in GEGLUS else n
    h0 = torch.randn(8192, n_out, device=dev)
    rope = (pos, cos, sin, D, 2 * arch.heads) if epi == Epi.ROPE else None

    def run(m, tiles=None, tma=None):
        o = h0[:m].clone() if epi == Epi.RESIDUAL else torch.empty(m, n_out, device=dev, dtype=torch.bfloat16)
        gemm(a[:m], w, o, epi=epi, bias=bias, bias_apart=kw.get("bias_apart", False),
             act=kw.get("act", Act.NONE), rope=None if rope is None else (pos[:m],) + rope[1:], tiles=tiles, tma=tma)
        return o
    canon = run(8192, ALT[0], tma=False)
    bad_tiles = []
    for t, tma in [(t, False) for t in ALT[1:]] + [(t, True) for t in ALT]:
        try:
            if not torch.equal(run(8192, t, tma=tma), canon):
                bad_tiles.append((t, tma))
        except Exception as e:       # a config the compiler refuses (shared memory): say so, go on
            print(f"   {t} tma={tma}: {repr(e)[:80]}")
    bad_m = [m for m in MS if not torch.equal(run(m), canon[:m])]
    if epi == Epi.RESIDUAL:
        ref = h0 + F.linear(a.float(), w.float(), None if bias is None else bias.float()).bfloat16().float()
    else:
        ref = None
    err = float((canon - ref).abs().max()) if ref is not None else float("nan")
    rec = {"n": n, "k": k, "epi": epi.name, "tiles_differ": [str(t) for t in bad_tiles], "m_differ": bad_m,
           "residual_max_err_vs_torch": err, "time": {}}
    if epi == Epi.RESIDUAL and k_chunk(k):     # K chunks are opt-in (LAYA_K_CHUNKS=1): only then a split exists
        rec["split"] = _split_case(name, a, w, bias, kw.get("bias_apart", False), h0, canon)
    print(f"{name:14s} N={n} K={k}: tiles differing {len(bad_tiles)}/{len(ALT) - 1} {bad_tiles}; "
          f"M differing {bad_m}; residual err {err:.3g}")
    for m in TIMED_MS:
        o = h0[:m].clone() if epi == Epi.RESIDUAL else torch.empty(m, n_out, device=dev, dtype=torch.bfloat16)
        flops, wbytes = 2 * m * n * k, 2 * n * k
        row = {}
        picked = pick_tiles(m, n_out, k, epi)
        variants = [(None, None)]
        if os.environ.get("PROBE_ALT_TIMES", "1") == "1":
            variants += [(t, False) for t in ALT] + [(t, True) for t in ALT if m > 512]
        for t, tma in variants:
            name_t = f"picked {picked}" if t is None else f"{t}{' tma' if tma else ''}"
            try:
                def fn(t=t, m=m, o=o, tma=tma):
                    gemm(a[:m], w, o, epi=epi, bias=bias, bias_apart=kw.get("bias_apart", False),
                         act=kw.get("act", Act.NONE), rope=None if rope is None else (pos[:m],) + rope[1:], tiles=t,
                         tma=tma)
                p50, p95 = graph_time(fn)
            except Exception as e:   # a config the compiler refuses (shared memory): say so, go on
                row[name_t] = repr(e)[:80]
                continue
            row[name_t] = (p50, p95)
        ob = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        p50, p95 = graph_time(lambda m=m, ob=ob: torch.matmul(a[:m], w.t(), out=ob))
        row["cublas"] = (p50, p95)
        best = min((v[0], kk) for kk, v in row.items() if isinstance(v, tuple) and kk != "cublas")
        pk = [v for kk, v in row.items() if kk.startswith("picked")][0]
        print(f"   M={m:5d}: picked {pk[0]:.4f}/{pk[1]:.4f} ({wbytes / pk[0] / 1e6:.0f} GB/s, "
              f"{flops / pk[0] / 1e9:.0f} TF/s) best {best[0]:.4f} {best[1]} | cuBLAS {p50:.4f} "
              f"({wbytes / p50 / 1e6:.0f} GB/s, {flops / p50 / 1e9:.0f} TF/s)")
        rec["time"][m] = row
    return rec


def _sweep_configs(m: int, epi: Epi) -> list[Tiles]:
    """The tile configurations the sweep times at one M: around what pick_tiles picks."""
    if m <= 64:
        out = [Tiles(64, bn, bk, 4, st) for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4, 6)]
        out += [Tiles(64, bn, 128, 8, 4) for bn in (32, 64)]       # two warpgroups: more loads issued at once
        if os.environ.get("PROBE_SMALL_BM") == "1":
            # only M tiles under one warpgroup (mma.sync, not wgmma): 3x the programs at M = 48. Same bits?
            out = [Tiles(bm, bn, 128, w, 4) for bm in (16, 32) for bn in (16, 32) for w in (1, 2, 4)
                   if not (bm == 32 and w == 1)] + [Tiles(16, 16, 256, 2, 3), Tiles(16, 16, 64, 2, 6)]
    else:
        bns = (32, 64, 128) if epi == Epi.GEGLU else (64, 128, 256)      # (GEGLU_PAIRS: both columns in BN)
        out = [Tiles(128, bn, 64, 8, st) for bn in bns for st in (2, 3, 4)] + [Tiles(64, bns[1], 64, 4, 4)]
        # deeper K tiles and two warpgroups along M: fewer loop trips, fewer programs per wave
        out += [Tiles(128, bns[1], 128, 8, 2), Tiles(256, bns[0], 64, 8, 3), Tiles(128, bns[1], 64, 4, 4)]
    if epi in GEGLUS and m <= 64:
        out = [t for t in out if t.bn <= (32 if epi == Epi.GEGLU else 64)]
    return out


def step_tiles(arch, report):
    """Time the encoder GEMMs at a grid of tilings per M; check each tiling's bits against the picked tiling's."""
    torch.manual_seed(0)
    dev, D = "cuda", arch.head_dim
    pos = torch.randint(0, arch.max_len, (8192,), device=dev, dtype=torch.int32)
    cos = torch.rand(arch.max_len, D // 2, device=dev)
    sin = torch.rand(arch.max_len, D // 2, device=dev)
    print("\n== tiles: graph-timed us per GEMM at each tiling (bits vs the picked tiling)")
    report["tiles"] = {}
    for name, (n, k, epi, _) in list(gemm_cases(arch).items())[:4]:
        rope = (pos, cos, sin, D, 2 * arch.heads) if epi == Epi.ROPE else None
        report["tiles"].update(_tile_case(name, n, k, epi, rope))


def _tile_case(name, n, k, epi, rope):
    dev = "cuda"
    a = torch.randn(8192, k, device=dev).bfloat16()
    w = (torch.randn(n, k, device=dev) / k ** 0.5).bfloat16()
    n_out = n // 2 if epi in GEGLUS else n
    h0 = torch.randn(8192, n_out, device=dev)
    parts = torch.empty(2, 2048, n_out, device=dev)
    ones = torch.ones(n_out, device=dev)

    # PROBE_COLD_W=N: time over N copies of the weights, one per call inside the timed graph, so that (N x the
    # weights > L2) every call reads its weights from memory as in a forward; otherwise they stay in L2 between
    # replays, which flatters small M (ncu, thirteenth session: ~2x). Bits are checked on the first copy.
    copies = [w] + [w.clone() for _ in range(int(os.environ.get("PROBE_COLD_W", "1")) - 1)]
    turn = itertools.cycle(copies)

    def call(m, t, o, timed=True):
        wt = next(turn) if timed else w
        if epi == Epi.RESIDUAL:
            return residual(a[:m], wt, o, parts, tiles=t)
        gemm(a[:m], wt, o, epi=epi, rope=None if rope is None else (rope[0][:m],) + rope[1:], tiles=t)
        return None

    def result(m, t):
        o = h0[:m].clone() if epi == Epi.RESIDUAL else torch.empty(m, n_out, device=dev, dtype=torch.bfloat16)
        pend = call(m, t, o, timed=False)
        if pend is not None:           # finished as the next LayerNorm would, for the bits
            rk.layer_norm(o, ones, None, torch.empty(m, n_out, device=dev, dtype=torch.bfloat16), 1e-5, pend)
        return o

    out = {}
    for m in [int(x) for x in os.environ.get("PROBE_TILE_MS", "48,1536,8192").split(",")]:
        canon = result(m, None)
        picked = pick_tiles(m, n_out, k, epi)
        row = {}
        for t in [None] + _sweep_configs(m, epi):
            label = f"picked {picked}" if t is None else str(t)
            try:
                same = t is None or bool(torch.equal(result(m, t), canon))
                o = h0[:m].clone() if epi == Epi.RESIDUAL else torch.empty(m, n_out, device=dev, dtype=torch.bfloat16)
                p50, _ = graph_time(lambda m=m, t=t, o=o: call(m, t, o), samples=15)
                row[label] = (round(p50 * 1e3, 2), same)
            except Exception as e:         # a config the compiler refuses (shared memory): say so, go on
                row[label] = repr(e)[:60]
        ok = {kk: v for kk, v in row.items() if isinstance(v, tuple)}
        best = sorted(ok.items(), key=lambda kv: kv[1][0])[:3]
        differ = [kk for kk, v in ok.items() if not v[1]]
        print(f"{name:12s} M={m:5d} picked {row.get(f'picked {picked}')} best {best} bits differ {differ}", flush=True)
        out[f"{name} {m}"] = row
    return out


def _split_case(name, a, w, bias, apart, h0, canon):
    """K chunks in their own programs, finished by the next LayerNorm: the same bits as the in-program chunks
    (`canon`) at every M a worker splits, at every tiling; and the time of GEMM + LayerNorm split or not."""
    dev, n = "cuda", w.shape[0]
    parts = torch.empty(8, 2048, n, device=dev)
    ones = torch.ones(n, device=dev)

    def run(m, split, tiles=None, chunk=None):
        o = h0[:m].clone()
        x = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        p = residual(a[:m], w, o, parts, bias=bias, bias_apart=apart, split=split, tiles=tiles, chunk=chunk)
        rk.layer_norm(o, ones, None, x, 1e-5, p)
        return o
    bad_m = [m for m in MS if m <= 2048 and not torch.equal(run(m, True), canon[:m])]
    bad_t = [str(t) for t in ALT[:5] if not torch.equal(run(48, True, t), canon[:48])]
    rec = {"m_differ": bad_m, "tiles_differ": bad_t, "time": {}}
    line = []
    for m in (48, 128, 1024, 1536):
        for label, split, chunk in (("auto", None, None), ("in-program", False, None), ("one chain", False, 0)):
            p50, p95 = graph_time(lambda m=m, s=split, c=chunk: run(m, s, chunk=c))
            rec["time"][f"{m} {label}"] = (p50, p95)
            line.append(f"M={m} {label} {p50 * 1e3:.1f}us")
    print(f"   split {name}: M differing {bad_m}, tiles differing {bad_t}; GEMM+LN: " + ", ".join(line))
    return rec


def _sdpa_ref(qkv, starts, lens, H, D, window, scale):
    out = torch.zeros(qkv.shape[0], H * D, device=qkv.device)
    for s, n in zip(starts, lens):
        x = qkv[s:s + n].float().view(n, 3, H, D)
        q, k, v = (x[:, i].transpose(0, 1) for i in range(3))
        i = torch.arange(n, device=qkv.device)
        mask = torch.ones(n, n, dtype=torch.bool, device=qkv.device)
        if window is not None:
            mask = (i[:, None] - i[None, :]).abs() <= window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[s:s + n] = o.transpose(0, 1).reshape(n, H * D)
    return out


def step_attention(arch, report):
    from laya_pool.kernels.attention import attention
    torch.manual_seed(1)
    dev = "cuda"
    H, D, W = arch.heads, arch.head_dim, arch.half_window
    rec = {}
    print("\n== attention: accuracy vs SDPA (fp32 math), invariance to the batch around a row, time")
    lens = [48, 200, 512, 7, 129, 300]
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist()
    T = sum(lens)
    qkv = torch.randn(T + 64, 3 * H * D, device=dev).bfloat16()
    st = torch.tensor(starts, device=dev, dtype=torch.int32)
    ln = torch.tensor(lens, device=dev, dtype=torch.int32)
    for kind, window in (("local", W), ("global", None)):
        o = torch.full((T + 64, H * D), float("nan"), device=dev, dtype=torch.bfloat16)
        attention(qkv, o, st, ln, H, D, max(lens), window, D ** -0.5)
        ref = _sdpa_ref(qkv, starts, lens, H, D, window, D ** -0.5)
        err = float((o[:T].float() - ref[:T]).abs().max())
        # Row 2 (512 tokens) alone, at offset 0, must give the same bits as inside the pack.
        s2, n2 = starts[2], lens[2]
        alone = torch.empty(n2, H * D, device=dev, dtype=torch.bfloat16)
        attention(qkv[s2:s2 + n2].contiguous(), alone, st[:1] * 0, ln[2:3], H, D, n2, window, D ** -0.5)
        same = torch.equal(alone, o[s2:s2 + n2])
        finite = bool(torch.isfinite(o[:T]).all())
        print(f"{kind:6s}: max |err| {err:.4f}, alone == packed {same}, finite {finite}")
        rec[kind] = {"max_err": err, "alone_equals_packed": same, "finite": finite, "time": {}}
        for R, L in ((1, 48), (32, 48), (16, 512)):
            q = torch.randn(R * L, 3 * H * D, device=dev).bfloat16()
            s = torch.arange(R, device=dev, dtype=torch.int32) * L
            n = torch.full((R,), L, device=dev, dtype=torch.int32)
            oo = torch.empty(R * L, H * D, device=dev, dtype=torch.bfloat16)
            p50, p95 = graph_time(lambda q=q, s=s, n=n, oo=oo, L=L, w=window: attention(q, oo, s, n, H, D, L, w, 0.125))
            keys = L if window is None else min(L, 2 * W + 1)
            fl = 4 * R * L * keys * D * H
            print(f"   {R}x{L}: {p50:.4f}/{p95:.4f} ms ({fl / p50 / 1e9:.0f} TF/s useful)")
            rec[kind]["time"][f"{R}x{L}"] = (p50, p95)
    report["attention"] = rec


def step_cublas(arch, report):
    """Does cuBLAS (torch's bf16 matmul) give our GEMM's bits? Per encoder/head (N, K) and per M the worker runs:
    our PLAIN bf16 product against F.linear on the same operands (both settings of torch's reduced-precision
    reduction flag), cuBLAS's rows at M against its own rows at M = 48, and both times. If they agree at an M, the
    raw product there may come from cuBLAS with our epilogue after it (issue 11's "start-up check")."""
    torch.manual_seed(0)
    dev = "cuda"
    ms = os.environ.get("PROBE_CUBLAS_MS", "48,64,96,128,256,512,1000,1024,1536,2048,4096,8192")
    ms = [int(x) for x in ms.split(",")]
    flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    print("\n== cublas: our PLAIN product's bits against cuBLAS (F.linear), per M; us p50 ours PLAIN / cuBLAS")
    rec = {}
    for name, (n, k, _epi, _) in gemm_cases(arch).items():
        a = torch.randn(8192, k, device=dev).bfloat16()
        w = (torch.randn(n, k, device=dev) / k ** 0.5).bfloat16()
        lone = F.linear(a[:48], w)
        row = {}
        for m in ms:
            ours = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            gemm(a[:m], w, ours)
            got = {}
            for reduced in (True, False):
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
                c = F.linear(a[:m], w)
                got[reduced] = (int((c != ours).sum()), bool(torch.equal(c[:48], lone)))
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag
            t_ours = t_cub = None
            if m in TIMED_MS or m == 1024:
                ob = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                t_ours = graph_time(lambda a=a[:m], w=w, o=ours: gemm(a, w, o), samples=10)[0]
                t_cub = graph_time(lambda a=a[:m], w=w, ob=ob: torch.matmul(a, w.t(), out=ob), samples=10)[0]
            row[m] = {"differ_default": got[True][0], "differ_fp32_reduction": got[False][0],
                      "cublas_rows_as_at_48": got[True][1], "us_ours_plain": t_ours and round(t_ours * 1e3, 2),
                      "us_cublas": t_cub and round(t_cub * 1e3, 2)}
        bad = {m: (r["differ_default"], r["differ_fp32_reduction"]) for m, r in row.items()
               if r["differ_default"] or r["differ_fp32_reduction"]}
        times = {m: (r["us_ours_plain"], r["us_cublas"]) for m, r in row.items() if r["us_cublas"]}
        print(f"{name:14s} N={n} K={k}: M where cuBLAS differs (elements: default, fp32 reduction) {bad or 'none'}; "
              f"cuBLAS rows as at 48: {all(r['cublas_rows_as_at_48'] for r in row.values())}; us {times}", flush=True)
        rec[name] = row
    report["cublas"] = rec


def _inputs(arch, R, L, K=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [L] * R
    ids = torch.randint(10, min(arch.vocab_size, 1000), (R * L,), generator=g, dtype=torch.int32)
    starts = torch.arange(R, dtype=torch.int32) * L
    mk = torch.full((R, K), -1, dtype=torch.int32)
    for r in range(R):
        mk[r] = torch.arange(5, 5 + 3 * K, 3)[:K]
    qt = torch.tensor([r % 3 for r in range(R)], dtype=torch.int32)
    d = "cuda"
    return dict(ids=ids.to(d), row_start=starts.to(d), row_len=torch.tensor(lens, dtype=torch.int32, device=d),
                qtype=qt.to(d), markers=mk.to(d), max_row_len=L)


def _family(name: str) -> str:
    for key in ("_gemm_kernel", "_attention_kernel", "_layer_norm_kernel", "_embed_kernel", "_head_entry_kernel",
                "_gather_norm_kernel", "_features_kernel", "_softmax_kernel", "_linear_kernel", "_rope_kernel"):
        if key in name:
            return key.strip("_")
    return "other: " + name[:40]


def _small_m_patches():
    """Tile and launch rules the model step can try in a whole forward (PROBE_MODEL_VARIANTS), each a list of
    (module, attribute, value) changes: at M <= 64 two warpgroups (w8), six stages (st6), the copy engine at every M
    (tma48); at 512 < M <= 2,048 other tile counts (mid64, mid256); attention tiles (att*). (cuBLAS's
    products, kernels/cublas.py, are on by default: the `nocublas` env variant turns them off.) Tiles and TMA never
    change the bits; the step checks it anyway."""
    from laya_pool.kernels import gemm as g
    base = g.pick_tiles

    def tiles(**change):
        def pick(m, n_out, k, epi, sms=132):
            t = base(m, n_out, k, epi, sms)
            return Tiles(**{**t.__dict__, **change}) if m <= 64 else t
        return pick

    def mid(plain: Tiles, paired: Tiles):
        # 512 < M <= 2,048 (a merged group of 32x48 is 1,536, 4x256 1,024). At 1,536 the default gives QKV 288 tiles of
        # 128x128 on 132 SMs (2.2 waves, the third a fifth full): mid64 makes them more and smaller (576 of 64x128,
        # residual GEMMs 64x128 too), mid256 fewer and fatter (144 of 128x256; residual GEMMs unchanged: fill_tiles
        # narrows them back to 128x64; at M = 1,024 QKV becomes one wave, launched early: `fill_tiles`' warning)
        def pick(m, n_out, k, epi, sms=132):
            if 512 < m <= 2048:
                if epi == Epi.GEGLU_PAIRS:       # both columns of a pair in BN
                    return Tiles(paired.bm, 2 * paired.bn, paired.bk, paired.warps, paired.stages)
                return paired if epi == Epi.GEGLU else plain
            return base(m, n_out, k, epi, sms)
        return pick

    from laya_pool.kernels import attention as at
    one = {"mid64": ("64x128 tiles, 4 warps (GeGLU 64x64), at 512 < M <= 2,048", g, "pick_tiles",
                     mid(Tiles(64, 128, 64, 4, 4), Tiles(64, 64, 64, 4, 4))),
           "mid256": ("128x256 tiles, 8 warps (GeGLU as now), at 512 < M <= 2,048", g, "pick_tiles",
                      mid(Tiles(128, 256, 64, 8, 3), Tiles(128, 64, 64, 8, 3))),
           "w8": ("8 warps at M <= 64", g, "pick_tiles", tiles(warps=8)),
           "st6": ("6 stages at M <= 64", g, "pick_tiles", tiles(stages=6)),
           "tma48": ("TMA at every M", g, "TMA_MIN_M", 0),
           # attention tiles (kernels/attention.py TILE: queries per program, warps, stages)
           "att128": ("attention 128 queries, 8 warps", at, "TILE", (128, 8, 2)),
           "att128s3": ("attention 128 queries, 8 warps, 3 stages", at, "TILE", (128, 8, 3)),
           "att64s3": ("attention 64 queries, 4 warps, 3 stages", at, "TILE", (64, 4, 3))}
    table = {name: (desc, [(mod, attr, value)]) for name, (desc, mod, attr, value) in one.items()}
    return table


WANT_VARIANTS = os.environ.get("PROBE_MODEL_VARIANTS", "pdl,tma,sdpa").split(",")


def step_model(model_dir, report):
    from laya_pool.kernels.fast import FastModel
    from laya_pool.kernels.reference import ReferenceModel
    from laya_pool.worker.checkpoint import load_checkpoint
    ck = load_checkpoint(model_dir)
    # explicit, so LAYA_ATTN in the environment cannot make the default and the variant the same model
    fast = FastModel(ck.arch, ck.tensors, device="cuda", attention="triton")
    sdpa_model = FastModel(ck.arch, ck.tensors, device="cuda", attention="sdpa") if "sdpa" in WANT_VARIANTS else None
    ref = ReferenceModel(ck.arch, ck.tensors, device="cuda", dtype=torch.bfloat16)
    rec = {}
    print("\n== model: fast vs reference (bf16, invariant GEMMs); graph replay ms p50/p95; kernels per forward")
    for R, L in ((1, 48), (32, 48), (4, 256), (16, 512)):
        inp = _inputs(ck.arch, R, L)
        lf, af = fast(**inp)
        lr, ar = ref(**inp)
        pf, pr = torch.softmax(lf, -1), torch.softmax(lr, -1)
        dp = float((pf - pr).abs().max())
        agree = float((pf.argmax(-1) == pr.argmax(-1)).float().mean())
        t_fast = graph_time(lambda inp=inp: fast(**inp), reps=1, samples=50)
        variants = {}
        # PROBE_MODEL_VARIANTS (comma-separated): pdl, tma, prefetch (off: the same bits?),
        # sdpa (torch's SDPA on the SDK's layout instead of our attention: its time, and whether the whole forward
        # gives the same bits)
        patches = _small_m_patches()
        envs = (("no PDL", {"LAYA_PDL": "0"}), ("no TMA", {"LAYA_TMA": "0"}), ("sdpa attention", {}),
                ("no prefetch", {"LAYA_PREFETCH": "0"}),
                ("PDL for single-wave grids only: waves", {"LAYA_PDL_WAVES": "one"}),
                ("epilogue operands read before the K loop at every M: early", {"LAYA_EARLY_EPI": "1"}),
                ("epilogue operands read after the K loop at every M: late", {"LAYA_EARLY_EPI": "0"}),
                ("RoPE tables read before the K loop at every M: rope", {"LAYA_EARLY_EPI": "rope"}),
                ("our GEMMs only, no cuBLAS products (kernels/cublas.py): nocublas", {"LAYA_CUBLAS": "0"}))
        for label, env in envs + tuple((k_, None) for k_ in patches):
            if env is None:
                if label not in WANT_VARIANTS:
                    continue
                desc, changes = patches[label]
                olds = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in changes]
                for mod, attr, value in changes:
                    setattr(mod, attr, value)
                forget()           # cached launches hold the tile choice made before the patch
                try:
                    lv, av = fast(**inp)
                    variants[desc] = (graph_time(lambda inp=inp: fast(**inp), reps=1, samples=30),
                                      bool(torch.equal(lv, lf) and torch.equal(av, af)),
                                      float((torch.softmax(lv, -1) - pr).abs().max()))
                finally:
                    for mod, attr, value in olds:
                        setattr(mod, attr, value)
                    forget()
                continue
            if label.split()[-1 if env else 0].lower() not in WANT_VARIANTS:
                continue
            model = sdpa_model if not env else fast
            os.environ.update(env)
            try:
                lv, av = model(**inp)
                variants[label] = (graph_time(lambda inp=inp, m=model: m(**inp), reps=1, samples=30),
                                   bool(torch.equal(lv, lf) and torch.equal(av, af)),
                                   float((torch.softmax(lv, -1) - pr).abs().max()))
            finally:
                for k_ in env:
                    os.environ.pop(k_)
        t_ref = graph_time(lambda inp=inp: ref(**inp), reps=1, samples=20)
        t0 = time.perf_counter()
        for _ in range(3):
            fast(**inp)
        torch.cuda.synchronize()
        eager = (time.perf_counter() - t0) / 3 * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fast(**inp)
            torch.cuda.synchronize()
        fam, cnt = collections.Counter(), collections.Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                f = _family(ev.name)
                fam[f] += ev.device_time_total / 1e3
                cnt[f] += 1
        key = f"{R}x{L}"
        for label, (tv, same, dpv) in variants.items():
            print(f"        {label}: {tv[0]:.3f}/{tv[1]:.3f} ms, same bits {same}, |dp| vs reference {dpv:.4f}")
        rec[key] = {"variants": variants,
                    "dp_max_vs_ref": dp, "agree_vs_ref": agree, "graph_fast": t_fast, "graph_ref": t_ref,
                    "eager_fast_ms": eager, "kernels": sum(cnt.values()),
                    "by_family": {k: (cnt[k], round(v, 4)) for k, v in fam.most_common()}}
        print(f"{key:7s} fast {t_fast[0]:.3f}/{t_fast[1]:.3f}  ref {t_ref[0]:.3f}/{t_ref[1]:.3f}  "
              f"ratio {t_ref[0] / t_fast[0]:.2f}x  eager {eager:.2f}  |dp| {dp:.4f} agree {agree:.3f}  "
              f"kernels {sum(cnt.values())} ({sum(fam.values()):.3f} ms)")
        for k, v in fam.most_common():
            print(f"      {k:24s} {cnt[k]:4d}  {v:.4f} ms")
    report["model"] = rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", default="gemm,attention,model")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    from laya_pool.worker.checkpoint import load_checkpoint
    arch = load_checkpoint(args.model).arch
    report = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "torch": torch.__version__}
    for step in args.steps.split(","):
        t = time.perf_counter()
        {"gemm": lambda: step_gemm(arch, report), "attention": lambda: step_attention(arch, report),
         "model": lambda: step_model(args.model, report), "tiles": lambda: step_tiles(arch, report),
         "cublas": lambda: step_cublas(arch, report)}[step]()
        print(f"[{step}: {time.perf_counter() - t:.1f} s]")
        json.dump(report, open(os.path.join(args.out, "probe_fast.json"), "w"), indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
