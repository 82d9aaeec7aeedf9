#!/usr/bin/env python3
"""Device probe (issue 11, small requests): does a GEMM that loads its first weight tiles BEFORE its PDL wait, and
only its activation tiles after, shorten a forward's chain of GEMMs? Same bits as ours?

    PYTHONPATH=$PWD python3 scripts/probe_preload.py [--ms 48,32,64] [--preloads 1,2,4] [--rolls 1,2,4]
                                                     [--wi-tiles pick,geglu]
    TRITON_INTERPRET=1 ... scripts/probe_preload.py --interpret-check     (CPU interpreter, fp16, values only)

At M = 48 a forward is 217 kernels, 124 of them GEMMs, in a CUDA graph with programmatic dependent launch
(kernels/launch.py): each GEMM's programs ask L2 for their weight rows (`prefetch`), wait for the kernel before
(`wait_turn`, griddepcontrol.wait) and only then start the K loop, whose first loads, activation and weight tiles
alike, are on the critical path. Weights never depend on an earlier kernel, so their first tiles could be in
flight before the wait.

`_preload_gemm` is a copy of kernels/gemm.py's `_gemm_kernel` on the path a GEMM of M <= 64 takes (pointer loads,
no TMA, one K chain, no bias, no activation) for two epilogues: PLAIN (bf16 out) and RESIDUAL (fp32 h += fp32(bf16
(acc)), the residual tile read before the loop as ours does at M <= 64: `early_epilogue`). PRELOAD (constexpr):
0: exactly ours (prefetch, wait_turn, the loop); N > 0: the first N weight tiles ([BK, BN], the dot's second operand)
loaded into registers with tl.load after the prefetch and before wait_turn. Then two forms (ROLL, constexpr):
- preloadN (ROLL off): after the wait the first N activation tiles are loaded and the N preloaded iterations run
  (tl.dot in ascending K), then a loop as ours runs the rest of K from tile N. In the sm_90 compile (Triton 3.6,
  ptxas of the wheel, on a host without a GPU) the preloaded tiles are stored to shared memory before the wait
  (griddepcontrol.wait waits for their arrival), the N activation tiles are plain loads after it, and the loop's
  cp.async prologue is issued only after the N preloaded dots: a second round trip after the wait.
- rollN (ROLL on): one loop over all of K in steps of N tiles, the activation tiles pipelined by Triton as ours are
  (cp.async prologue right after the wait); weight tile j of a step comes from a register tile loaded one step
  earlier (the first step's before the wait), and each step asks for the next step's N weight tiles: the weights
  always N tiles ahead, through registers (ld.global, st.shared) instead of cp.async. Stages: as many activation
  tiles ahead as ours keeps. (A queue carried across more than one iteration made Triton's pipeliner drop the loop.)
One fp32 accumulator from zero, K ascending in BK tiles of tl.dot (tiles past K, when K is not a multiple of N
tiles, are zeros and add +0 to an accumulator that is never -0): the same MMA chain as ours, so the bits must be
ours. sm_90 compile at M = 48 (registers, no spills anywhere): ours 56 (QKV, Wo, Wi; 94 Wi@geglu); preload1/2/4
64-76 (96 Wi@geglu), shared memory 96 -> 120 KB; roll1/2/4 79/111/155 QKV, 64/92/113 Wo, 128/180/242 Wi@geglu.

Shapes (the large model, hidden 1,024, 28 layers): QKV N 3,072 K 1,024 (PLAIN; ours ROPE in a forward), Wo N 1,024
K 1,024 (RESIDUAL), Wi N 5,248 K 1,024 (PLAIN, for the GEGLU product), Wo_mlp N 1,024 K 2,624 (RESIDUAL). Tiles as
`_launch` picks them (`pick_tiles`, and `fill_tiles` for RESIDUAL), launch options from `launch.launch`, prefetch
as `prefetching` says. `--wi-tiles geglu`: Wi at 64x64x128, 3 stages instead (82 programs, one wave, prefetching:
the grid and weight bytes a program of the forward's GEGLU GEMM has, 2 x 32 columns of the 2 x 2,624; PLAIN's
pick_tiles gives 164 programs of 32 columns, two waves, launched LATE and without prefetch).

Variants: ours, preload0 (our kernel's copy: its bits and time should be ours), preloadN, rollN.
Steps, one line each, every variant in its own try (a failure prints its first line and the run goes on):
1. registers and spills of each compiled kernel (ours, and PRELOAD 0 / N) by shape;
2. bits: each shape at each M, ours (`gemm` / `residual(a, w, h, None)`) against `_preload_gemm` at every PRELOAD,
   torch.equal from the same inputs (residual: the same starting h);
3. alone: p50 us per call of each shape, a CUDA graph of 20 back-to-back launches of itself;
4. chain, as a forward sees it: a CUDA graph of 28 layers x (QKV, Wo, Wi, Wo_mlp), each layer its own weights
   (24.5 MB a layer, 687 MB in all: from HBM, as in a forward), the launches back to back under PDL as ours are;
   Wo reads QKV's first 1,024 columns, Wo_mlp Wi's first 2,624, QKV and Wi a fixed activation. p50 / p95 ms of 50
   replays after 5 warm-ups, the ratio to ours, and the bits of a replay from the same state (h, QKV's and Wi's
   outputs) against ours.
A watchdog (faulthandler, `--hang-s`, re-armed at each step) ends a hung run after printing where it hung.
"""
from __future__ import annotations

import argparse
import faulthandler
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

INTERPRET = "--interpret-check" in sys.argv
if INTERPRET:
    os.environ.setdefault("TRITON_INTERPRET", "1")     # read when the kernels below are decorated

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]

from probe_fast import graph_time, replay_ms  # noqa: E402
from probe_wsgemm import jit_compiled  # noqa: E402

import laya_pool.kernels.gemm as gm  # noqa: E402
from laya_pool.kernels.gemm import Epi, Tiles, early_epilogue, fill_tiles, gemm, pick_tiles, residual  # noqa: E402
from laya_pool.kernels.launch import launch, prefetch, prefetching, wait_turn  # noqa: E402


@triton.jit
def _w_tile(w_ptrs, cols, rk, K, i: tl.constexpr, BK: tl.constexpr, N_OUT):
    """Weight tile i ([BK, BN], K rows from i * BK), zeros past K and past N (as ours masks it)."""
    kk = i * BK + rk
    return tl.load(w_ptrs + i * BK, mask=(cols < N_OUT)[None, :] & (kk < K)[:, None], other=0.0)


@triton.jit
def _a_tile(a_ptrs, row_ok, rk, K, i: tl.constexpr, BK: tl.constexpr):
    """Activation tile i ([BM, BK]), zeros past K and past M."""
    kk = i * BK + rk
    return tl.load(a_ptrs + i * BK, mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def _roll_step(acc, a_ptrs, w_ptrs, b, k0, row_ok, col_ok, rk, K, J: tl.constexpr, N: tl.constexpr,
               BK: tl.constexpr):
    """ROLL's sub-step J of the step at k0: acc += a tile (k0 / BK + J) @ b; returns it and the weight tile N on
    (the same sub-step's tile of the next step), zeros past K."""
    kk = k0 + J * BK + rk
    a = tl.load(a_ptrs + J * BK, mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
    nxt = tl.load(w_ptrs + (N + J) * BK, mask=col_ok[None, :] & (kk + N * BK < K)[:, None], other=0.0)
    return tl.dot(a, b, acc), nxt


@triton.jit
def _preload_gemm(a_ptr, w_ptr, out_ptr, M, N_OUT, K, sam, swn, som,
                  EPI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_GDC: tl.constexpr,
                  PREFETCH: tl.constexpr, W_BYTES: tl.constexpr, PIECES: tl.constexpr, EARLY: tl.constexpr,
                  PRELOAD: tl.constexpr, ROLL: tl.constexpr = False):
    """out <- a @ w.T (EPI 0: bf16) or out += fp32(bf16(a @ w.T)) (EPI 1: fp32 h), `_gemm_kernel`'s small-M path;
    PRELOAD (0..8) weight tiles loaded before the wait; ROLL (PRELOAD 1..4): they are a queue that the one K loop
    keeps PRELOAD tiles ahead (module docstring)."""
    CD: tl.constexpr = w_ptr.dtype.element_ty          # the compute dtype (ours: bias_ptr, which is w without bias)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if PREFETCH:
        if pid_m == 0:
            nbytes = tl.minimum(BN, N_OUT - pid_n * BN) * K * W_BYTES
            prefetch(w_ptr + pid_n * BN * swn, nbytes, PIECES)
    rk = tl.arange(0, BK)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N_OUT
    w_ptrs = w_ptr + cols[None, :] * swn + rk[:, None]
    # Weights depend on no earlier kernel: their first tiles are asked for before the wait.
    if PRELOAD >= 1:
        b0 = _w_tile(w_ptrs, cols, rk, K, 0, BK, N_OUT)
    if PRELOAD >= 2:
        b1 = _w_tile(w_ptrs, cols, rk, K, 1, BK, N_OUT)
    if PRELOAD >= 3:
        b2 = _w_tile(w_ptrs, cols, rk, K, 2, BK, N_OUT)
    if PRELOAD >= 4:
        b3 = _w_tile(w_ptrs, cols, rk, K, 3, BK, N_OUT)
    if PRELOAD >= 5:
        b4 = _w_tile(w_ptrs, cols, rk, K, 4, BK, N_OUT)
    if PRELOAD >= 6:
        b5 = _w_tile(w_ptrs, cols, rk, K, 5, BK, N_OUT)
    if PRELOAD >= 7:
        b6 = _w_tile(w_ptrs, cols, rk, K, 6, BK, N_OUT)
    if PRELOAD >= 8:
        b7 = _w_tile(w_ptrs, cols, rk, K, 7, BK, N_OUT)
    wait_turn(USE_GDC)
    rm = pid_m * BM + tl.arange(0, BM)
    row_ok = rm < M
    if EARLY:
        if EPI == 1:
            h_early = tl.load(out_ptr + rm[:, None] * som + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                              other=0.0)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    a_ptrs = a_ptr + rm[:, None] * sam + rk[None, :]
    if ROLL:
        # One loop over all of K in steps of PRELOAD tiles, its activation tiles pipelined by Triton as ours are
        # (cp.async, the prologue issued right after the wait). Sub-step j of a step multiplies by weight register
        # tile b_j, loaded one step earlier (before the wait for the first step), and asks for its successor one
        # step ahead: each b_j is carried one iteration (a longer carry makes Triton's pipeliner give up on the
        # loop). Past K: zero tiles (masked, no traffic), which add +0 to an accumulator that is never -0.
        tl.static_assert(PRELOAD >= 1 and PRELOAD <= 4)
        for k0 in range(0, K, PRELOAD * BK):
            acc, b0 = _roll_step(acc, a_ptrs, w_ptrs, b0, k0, row_ok, col_ok, rk, K, 0, PRELOAD, BK)
            if PRELOAD >= 2:
                acc, b1 = _roll_step(acc, a_ptrs, w_ptrs, b1, k0, row_ok, col_ok, rk, K, 1, PRELOAD, BK)
            if PRELOAD >= 3:
                acc, b2 = _roll_step(acc, a_ptrs, w_ptrs, b2, k0, row_ok, col_ok, rk, K, 2, PRELOAD, BK)
            if PRELOAD >= 4:
                acc, b3 = _roll_step(acc, a_ptrs, w_ptrs, b3, k0, row_ok, col_ok, rk, K, 3, PRELOAD, BK)
            a_ptrs += PRELOAD * BK
            w_ptrs += PRELOAD * BK
    else:
        # The preloaded iterations: their activation tiles all asked for first, then the dots in ascending K. (A tile
        # past K, where K < PRELOAD * BK, is zeros on both sides and adds +0 to an accumulator that is never -0: acc.)
        if PRELOAD >= 1:
            a0 = _a_tile(a_ptrs, row_ok, rk, K, 0, BK)
        if PRELOAD >= 2:
            a1 = _a_tile(a_ptrs, row_ok, rk, K, 1, BK)
        if PRELOAD >= 3:
            a2 = _a_tile(a_ptrs, row_ok, rk, K, 2, BK)
        if PRELOAD >= 4:
            a3 = _a_tile(a_ptrs, row_ok, rk, K, 3, BK)
        if PRELOAD >= 5:
            a4 = _a_tile(a_ptrs, row_ok, rk, K, 4, BK)
        if PRELOAD >= 6:
            a5 = _a_tile(a_ptrs, row_ok, rk, K, 5, BK)
        if PRELOAD >= 7:
            a6 = _a_tile(a_ptrs, row_ok, rk, K, 6, BK)
        if PRELOAD >= 8:
            a7 = _a_tile(a_ptrs, row_ok, rk, K, 7, BK)
        if PRELOAD >= 1:
            acc = tl.dot(a0, b0, acc)
        if PRELOAD >= 2:
            acc = tl.dot(a1, b1, acc)
        if PRELOAD >= 3:
            acc = tl.dot(a2, b2, acc)
        if PRELOAD >= 4:
            acc = tl.dot(a3, b3, acc)
        if PRELOAD >= 5:
            acc = tl.dot(a4, b4, acc)
        if PRELOAD >= 6:
            acc = tl.dot(a5, b5, acc)
        if PRELOAD >= 7:
            acc = tl.dot(a6, b6, acc)
        if PRELOAD >= 8:
            acc = tl.dot(a7, b7, acc)
        # The rest of K: ours' loop from tile PRELOAD on.
        a_ptrs += PRELOAD * BK
        w_ptrs += PRELOAD * BK
        for k0 in range(PRELOAD * BK, K, BK):
            k_ok = (k0 + rk) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BK
            w_ptrs += BK
    out_ptrs = out_ptr + rm[:, None] * som + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    y = acc.to(CD).to(tl.float32)
    if EPI == 0:
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        if EARLY:
            h = h_early
        else:
            h = tl.load(out_ptrs, mask=ok, other=0.0)
        tl.store(out_ptrs, h + y, mask=ok)


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    k: int
    epi: Epi
    tiles: Tiles | None = None       # None: as `_launch` picks them


HIDDEN, FF, LAYERS = 1024, 2624, 28
GEGLU_GRID = Tiles(64, 64, 128, 4, 3)      # a GEGLU program's grid and weight bytes (module docstring; the
#                                           forward's GEGLU_PAIRS at M <= 64: the same grid, 4 stages)


def shapes(wi_tiles: str) -> list[Shape]:
    return [Shape("QKV", 3 * HIDDEN, HIDDEN, Epi.PLAIN), Shape("Wo", HIDDEN, HIDDEN, Epi.RESIDUAL),
            Shape("Wi", 2 * FF, HIDDEN, Epi.PLAIN, GEGLU_GRID if wi_tiles == "geglu" else None),
            Shape("Wo_mlp", HIDDEN, FF, Epi.RESIDUAL)]


def tiles_for(s: Shape, m: int, sms: int) -> Tiles:
    """The tiles `_launch` gives this shape at M rows (or the shape's own)."""
    if s.tiles is not None:
        return s.tiles
    t = pick_tiles(m, s.n, s.k, s.epi, sms)
    return fill_tiles(t, m, s.n, sms) if s.epi == Epi.RESIDUAL else t


def ours(s: Shape, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """The library's GEMM (its plan cache and launcher), one K chain."""
    if s.epi == Epi.RESIDUAL:
        residual(a, w, out, None, chunk=0, tiles=s.tiles)
    else:
        gemm(a, w, out, tiles=s.tiles)


def preload_launch(s: Shape, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, variant: tuple, sms: int):
    """`_preload_gemm` with `_launch`'s tiles, launch options and prefetch decision; returns what Triton's launch
    returned (the compiled kernel on a GPU). variant: (PRELOAD, ROLL)."""
    preload, roll = variant
    m, k = a.shape
    n = w.shape[0]
    assert a.stride(1) == 1 and w.is_contiguous() and out.stride(-1) == 1 and w.shape[1] == k and n == s.n
    t = tiles_for(s, m, sms)
    grid = (triton.cdiv(m, t.bm), triton.cdiv(n, t.bn), 1)
    options = launch(a.device, grid[0] * grid[1])
    ahead = prefetching(options) and w.data_ptr() % 16 == 0 and (k * w.element_size()) % 16 == 0
    stages = t.stages
    if roll:        # as many activation tiles ahead as ours keeps (stages - 1), in steps of `preload` tiles
        stages = max(2, -(-(t.stages - 1) // preload) + 1)
    return _preload_gemm[grid](a, w, out, m, n, k, a.stride(0), w.stride(0), out.stride(0),
                               EPI=int(s.epi), BM=t.bm, BN=t.bn, BK=t.bk, PREFETCH=ahead, W_BYTES=w.element_size(),
                               PIECES=32 * t.warps, EARLY=early_epilogue(m, s.epi), PRELOAD=preload, ROLL=roll,
                               **options, num_warps=t.warps, num_stages=stages)


def make_inputs(m: int, s: Shape, device: str, dtype: torch.dtype, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(m, s.k, device=device, dtype=torch.float32, generator=g).to(dtype)
    w = (torch.randn(s.n, s.k, device=device, dtype=torch.float32, generator=g) / math.sqrt(s.k)).to(dtype)
    if s.epi == Epi.RESIDUAL:
        out = torch.randn(m, s.n, device=device, dtype=torch.float32, generator=g)
    else:
        out = torch.full((m, s.n), float("nan"), device=device, dtype=dtype)
    return a, w, out


def vname(v) -> str:
    """ours, preloadN (PRELOAD N, unrolled), rollN (PRELOAD N, ROLL)."""
    return "ours" if v is None else f"{'roll' if v[1] else 'preload'}{v[0]}"


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def describe(compiled) -> str:
    """Registers, spills, shared memory of a compiled kernel (a courtesy: never costs the line)."""
    try:
        compiled._init_handles()
        return (f"regs={compiled.n_regs} spills={compiled.n_spills} warps={compiled.metadata.num_warps} "
                f"smem={compiled.metadata.shared // 1024}K")
    except Exception as e:
        return f"(no description: {type(e).__name__})"


def interpret_check(variants: list[tuple]) -> None:
    """Triton's CPU interpreter, fp16 (it cannot multiply bf16), no PDL (its inline assembly is not interpreted:
    `launch` gives a CPU tensor no wait and no prefetch): each PRELOAD against ours under the same interpreter, at
    shapes with ragged M, N and K edges, K shorter than the preloaded tiles, and a strided activation."""
    cases = [(48, 96, 640), (48, 96, 600), (33, 80, 200), (64, 64, 1024)]
    for m, n, k in cases:
        for epi in (Epi.PLAIN, Epi.RESIDUAL):
            s = Shape(f"{epi.name.lower()}", n, k, epi)
            a, w, out0 = make_inputs(m, s, "cpu", torch.float16, m + n + k + int(epi))
            if m == 48:                     # a row stride of its own, as Wo and Wo_mlp read QKV's and Wi's outputs
                a = torch.cat([a, torch.zeros(m, 8, dtype=a.dtype)], dim=1)[:, :k]
            ref = out0.clone()
            ours(s, a, w, ref)
            y = (a.float() @ w.float().T).to(torch.float16)
            exact = out0 + y.float() if epi == Epi.RESIDUAL else y
            t = tiles_for(s, m, 132)
            print(f"interpret {s.name:8s} M={m} N={n} K={k} tiles={t.bm}x{t.bn}x{t.bk}: ours against torch's fp32 "
                  f"product: max |diff| {float((ref.float() - exact.float()).abs().max()):.3g}", flush=True)
            for v in variants:
                got = out0.clone()
                try:
                    preload_launch(s, a, w, got, v, 132)
                except Exception as e:
                    print(f"interpret   {vname(v):9s}: failed: {first_line(e)}", flush=True)
                    continue
                same = torch.equal(got, ref)
                print(f"interpret   {vname(v):9s}: bits={same}" + ("" if same else f" ndiff={int((got != ref).sum())}"),
                      flush=True)


def graph_us(fn, calls: int = 20, samples: int = 30) -> float:
    """p50 us per call of `fn`: a CUDA graph of `calls` back-to-back calls, timed `samples` times (probe_fast's)."""
    return graph_time(fn, reps=calls, samples=samples)[0] * 1000.0


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class Chain:
    """28 layers x (QKV, Wo, Wi, Wo_mlp), each layer its own weights; buffers shared by every variant."""

    def __init__(self, ss: list[Shape], m: int, weights: list[dict], seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.ss, self.m, self.weights = ss, m, weights
        self.x = torch.randn(m, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        self.h0 = torch.randn(m, HIDDEN, device="cuda", generator=g)
        self.h = self.h0.clone()
        self.qkv = torch.empty(m, 3 * HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.wi = torch.empty(m, 2 * FF, device="cuda", dtype=torch.bfloat16)

    def steps(self):
        """(shape, a, w, out) in a forward's order."""
        qkv, wo, wi, wo2 = self.ss
        for lw in self.weights:
            yield qkv, self.x, lw["QKV"], self.qkv
            yield wo, self.qkv[:, :HIDDEN], lw["Wo"], self.h
            yield wi, self.x, lw["Wi"], self.wi
            yield wo2, self.wi[:, :FF], lw["Wo_mlp"], self.h

    def run(self, variant, sms: int) -> None:
        for s, a, w, out in self.steps():
            if variant is None:
                ours(s, a, w, out)
            else:
                preload_launch(s, a, w, out, variant, sms)

    def state(self) -> tuple:
        return self.h.clone(), self.qkv.clone(), self.wi.clone()

    def time(self, variant, sms: int, warm: int = 5, reps: int = 50):
        """(p50 ms, p95 ms, state after one replay from h0) of a graph of the whole chain."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.run(variant, sms)              # compiles, off the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.run(variant, sms)
        self.h.copy_(self.h0)
        self.qkv.zero_()
        self.wi.zero_()
        g.replay()
        torch.cuda.synchronize()
        state = self.state()
        for _ in range(warm):
            g.replay()
        torch.cuda.synchronize()
        times = replay_ms(g, reps)
        del g
        return statistics.median(times), percentile(times, 0.95), state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="48,32,64", help="M values (the first one gets every step, the rest the chain)")
    ap.add_argument("--preloads", default="1,2,4", help="PRELOAD values besides 0 (at most 8)")
    ap.add_argument("--rolls", default="1,2,4", help="PRELOAD values of the ROLL form (at most 4)")
    ap.add_argument("--wi-tiles", default="pick,geglu", help="pick: pick_tiles' (164 programs); geglu: 64x64x128")
    ap.add_argument("--hang-s", type=float, default=150.0, help="watchdog, re-armed at each step")
    ap.add_argument("--budget-s", type=float, default=170.0, help="no new step after this many seconds")
    ap.add_argument("--interpret-check", action="store_true")
    args = ap.parse_args()
    preloads = [int(x) for x in args.preloads.split(",") if x]
    rolls = [int(x) for x in args.rolls.split(",") if x]
    assert all(1 <= p <= 8 for p in preloads) and all(1 <= p <= 4 for p in rolls), (preloads, rolls)
    variants: list = [None, (0, False), *((p, False) for p in preloads), *((p, True) for p in rolls)]   # None: ours
    if args.interpret_check:
        interpret_check(variants[1:])
        return
    t_start = time.time()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)} sms={sms} torch {torch.__version__} triton {triton.__version__} "
          + " ".join(f"{k}={os.environ.get(k, '-')}" for k in ("LAYA_PDL", "LAYA_PREFETCH", "LAYA_PDL_WAVES",
                                                                 "LAYA_EARLY_EPI", "LAYA_LAUNCH_CACHE")), flush=True)
    ms = [int(x) for x in args.ms.split(",")]
    wi_modes = [x for x in args.wi_tiles.split(",") if x]

    def step(label: str) -> bool:
        """Re-arm the watchdog; False once the budget is spent."""
        faulthandler.cancel_dump_traceback_later()
        if time.time() - t_start > args.budget_s:
            print(f"{label}: skipped (budget of {args.budget_s:.0f} s spent)", flush=True)
            return False
        faulthandler.dump_traceback_later(args.hang_s, exit=True)
        return True

    # Steps 1-3, shape by shape: registers, bits at every M, alone at the first M.
    bits_ok: dict = {v: True for v in variants}
    ours_desc: dict = {}
    m0 = ms[0]
    all_shapes = {s.name + ("" if s.tiles is None else "@geglu"): s for mode in wi_modes for s in shapes(mode)}
    for key, s in all_shapes.items():
        t = tiles_for(s, m0, sms)
        programs = triton.cdiv(m0, t.bm) * triton.cdiv(s.n, t.bn)
        opts = launch(dev, programs)
        print(f"--- {key} N={s.n} K={s.k} {s.epi.name} M={m0}: tiles {t.bm}x{t.bn}x{t.bk} warps={t.warps} "
              f"stages={t.stages} programs={programs} USE_GDC={opts['USE_GDC']} pdl={opts['launch_pdl']} "
              f"prefetch={prefetching(opts)} early={early_epilogue(m0, s.epi)}", flush=True)
        alone: dict = {}
        kind = (s.epi, t, opts["USE_GDC"], prefetching(opts))
        for v in variants:
            if not step(f"{key} {vname(v)}"):
                break
            try:
                desc, same_all, notes = "", True, []
                for m in ms:
                    a, w, out0 = make_inputs(m, s, "cuda", torch.bfloat16, 7 * s.n + s.k + m)
                    ref = out0.clone()
                    before = {id(x) for x in jit_compiled(gm._gemm_kernel)}
                    ours(s, a, w, ref)
                    got = out0.clone()
                    if v is None:
                        new = [x for x in jit_compiled(gm._gemm_kernel) if id(x) not in before]
                        if new and not desc:
                            desc = describe(new[0])
                        ours(s, a, w, got)            # ours again: deterministic?
                    else:
                        compiled = preload_launch(s, a, w, got, v, sms)
                        if not desc:
                            desc = describe(compiled)
                    torch.cuda.synchronize()
                    same = torch.equal(got, ref)
                    same_all &= same
                    if not same:
                        notes.append(f"M={m}: ndiff={int((got != ref).sum())}")
                    if m == m0:
                        out = out0.clone()
                        if v is None:
                            alone[v] = graph_us(lambda s=s, a=a, w=w, out=out: ours(s, a, w, out))
                        else:
                            alone[v] = graph_us(lambda s=s, a=a, w=w, out=out, v=v:
                                                preload_launch(s, a, w, out, v, sms))
                bits_ok[v] &= same_all
                ratio = alone[v] / alone[None] if None in alone else float("nan")
                if v is None:       # Wo and Wo_mlp share ours' kernel: compiled once, described once
                    if desc:
                        ours_desc[kind] = desc
                    desc = ours_desc.get(kind, "(no description)")
                print(f"{key:10s} {vname(v):9s} alone {alone[v]:7.2f} us x{ratio:5.3f}  "
                      f"bits(M={','.join(map(str, ms))})={same_all} {' '.join(notes)}  {desc}", flush=True)
            except Exception as e:
                bits_ok[v] = False
                print(f"{key:10s} {vname(v):9s} failed: {first_line(e)}", flush=True)
                if "illegal" in str(e) or "launch failure" in str(e):
                    print("the CUDA context is gone; stopping", flush=True)
                    return

    # Step 4: the chain, per Wi tiling and M.
    if not step("weights"):
        return
    g = torch.Generator(device="cuda").manual_seed(11)
    weights = []
    for _ in range(LAYERS):
        layer = {}
        for s in shapes("pick"):
            layer[s.name] = (torch.randn(s.n, s.k, device="cuda", generator=g) / math.sqrt(s.k)).to(torch.bfloat16)
        weights.append(layer)
    mb = sum(w.numel() * w.element_size() for layer in weights for w in layer.values()) / 2**20
    print(f"chain: {LAYERS} layers x 4 GEMMs, {mb:.0f} MiB of weights; shape steps bits across all: "
          + " ".join(f"{vname(v)}={ok}" for v, ok in bits_ok.items()), flush=True)
    for m in ms:
        for mode in wi_modes:
            chain = Chain(shapes(mode), m, weights, 100 + m)
            base = None
            ref_state = None
            for v in variants:
                head = f"chain wi={mode:5s} M={m:3d} {vname(v):9s}"
                if not step(head):
                    return
                try:
                    p50, p95, state = chain.time(v, sms)
                    if v is None:
                        base, ref_state = p50, state
                    same = ref_state is not None and all(torch.equal(x, y) for x, y in zip(state, ref_state))
                    ratio = p50 / base if base else float("nan")
                    print(f"{head} {p50:7.4f} / {p95:7.4f} ms (p50/p95)  x{ratio:5.3f} ours  "
                          f"({(p50 - base) * 1e3 / (4 * LAYERS) if base else float('nan'):+6.2f} us a GEMM)  "
                          f"bits={same}", flush=True)
                except Exception as e:
                    print(f"{head} failed: {first_line(e)}", flush=True)
                    if "illegal" in str(e) or "launch failure" in str(e):
                        print("the CUDA context is gone; stopping", flush=True)
                        return
            del chain
    faulthandler.cancel_dump_traceback_later()
    print(f"done in {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
