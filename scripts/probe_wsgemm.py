#!/usr/bin/env python3
"""Device probe (issue 17, long requests): can a residual GEMM whose epilogue overlaps the next tile's main loop beat
ours, and give the same bits?

    PYTHONPATH=$PWD python3 scripts/probe_wsgemm.py [--only NAME,NAME] [--shapes 1024x1024,1024x2624] [--ms 1536,8192]
    TRITON_INTERPRET=1 ... scripts/probe_wsgemm.py --interpret-check     (CPU interpreter, fp16, bits only)

h += a @ w.T on an fp32 residual stream h [M, N] (a [M, K] bf16, w [N, K] bf16), against our kernel
(`kernels.gemm.residual`: at M = 8,192 one 128x128 tile a program, 8 warps, 3 stages, TMA operands) and cuBLAS's
plain bf16 product (`F.linear(a, w)`, bf16 out, no residual). Every candidate keeps the batch-invariant chain: each
output element one fp32 accumulator from zero, K ascending in BK = 64 tiles of wgmma k16 steps (`tl.dot`), then
y = fp32(bf16(acc)), then h += y in fp32. What differs: tiles in M/N, warps, stages, persistence, and how the epilogue
meets the main loop of the next tile.

Candidates (`CANDIDATES`; `p`: persistent, `t`: one tile a program; then BMxBN):
- sub_*: one tile a program, the epilogue in column slices (`s2`, `s4`: the fp32 h tile read, added and written 2 or
  4 slices at a time), about 90 registers, so two programs share an SM and one's epilogue overlaps the other's main
  loop. (Ours compiles to 124 registers and 96 KB with this Triton: two programs an SM fit already; the `ours` line
  prints what the device's compile gives.)
- pers_*: persistent (grid = SMs, program p runs tiles p, p + SMs, ...), nothing else: the baseline for the next two.
- flat_*, flat2_*: persistent, `tl.range(..., flatten=True)`: the K loop fused into the tile loop and software
  pipelined as one loop, so tile i+1's TMA loads are in flight while tile i's epilogue runs; flat2: two programs an
  SM (grid = 2 x SMs).
- ws_*: persistent, `tl.range(..., warp_specialize=True)` on the tile loop: Triton 3.6's Hopper automatic warp
  specialization (the nvgpu-warp-specialization pass, third_party/nvidia/hopper, which the nvidia backend's make_ttgir
  runs for capability 9.x) gives the TMA loads to a producer warpgroup and the MMAs and the epilogue to two consumer
  warpgroups of 64 rows each, so the next tile's loads run under the epilogue. Not flattened (Triton's tutorial 09:
  "Hopper warpspec doesn't work with flatten"). `ws=yes` in a line: `ttg.warp_specialize` is in the compiled TTGIR
  (the pass took rather than dropping the attribute).
- *_tmah: h read and written through TMA (descriptor load and store of each slice) instead of pointer loads.
- *_red: h += y as a TMA reduce-add (cp.reduce.async.bulk.tensor .add, f32): the SM never reads h, L2 adds. The same
  fp32 round-to-nearest add, but PTX's f32 atomic adds flush subnormals to zero, so it could differ from ours where h,
  y or h + y is subnormal; the bits column says whether it did on this data.

One line per (candidate, N, K, M): p50 us per call (a CUDA graph of 20 back-to-back calls, 30 samples), ratio to
cuBLAS plain, ratio to ours, bits equal to ours from the same starting h (and how many elements differ if not), then
the compiled kernel's registers, spills, warps, shared memory and programs an SM fits. A candidate that does not
compile gets one line with the error's first line and the others go on; a watchdog (`--hang-s`) ends the run if a
kernel hangs (warp specialization is an experimental pass), after printing where.

--interpret-check: Triton's CPU interpreter (it cannot multiply bf16: fp16 there) at M = N = K = 128 and at
320 x 384 x 192 (several tiles a program, ragged edges), each candidate against ours under the same interpreter:
indexing, slices and the epilogue's arithmetic. Warps, stages, flattening and warp specialization mean nothing
there, and the TMA reduce, which the interpreter lacks, is emulated.
"""
from __future__ import annotations

import argparse
import faulthandler
import math
import os
import statistics
import sys
from dataclasses import dataclass

INTERPRET = "--interpret-check" in sys.argv
if INTERPRET:
    os.environ.setdefault("TRITON_INTERPRET", "1")     # read when the kernels below are decorated

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import laya_pool.kernels.gemm as gm  # noqa: E402
from laya_pool.kernels.gemm import residual  # noqa: E402

H_PTR, H_TMA, H_RED = 0, 1, 2          # how the epilogue reads and writes h


@triton.jit
def _acc_tile(a_desc, w_desc, m0, n0, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One tile's product: one fp32 accumulator from zero, K ascending (past K the copy engine reads zeros, which add
    nothing)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        acc = tl.dot(a_desc.load([m0, k0]), w_desc.load([n0, k0]).T, acc)
    return acc


@triton.jit
def _add_slice(y, h_ptr, h_desc, m0, n0, M, N, shm, BM: tl.constexpr, BS: tl.constexpr, H_MODE: tl.constexpr):
    """h[m0:m0+BM, n0:n0+BS] += y (fp32)."""
    if H_MODE == 2:
        h_desc.atomic_add([m0, n0], y)
    elif H_MODE == 1:
        h_desc.store([m0, n0], h_desc.load([m0, n0]) + y)
    else:
        rows = m0 + tl.arange(0, BM)
        cols = n0 + tl.arange(0, BS)
        ptrs = h_ptr + rows[:, None].to(tl.int64) * shm + cols[None, :]
        ok = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + y, mask=ok)


@triton.jit
def _halves(y, BM: tl.constexpr, BN: tl.constexpr):
    """y's columns [0, BN/2) and [BN/2, BN)."""
    return tl.split(tl.permute(tl.reshape(y, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def _epilogue(acc, h_ptr, h_desc, m0, n0, M, N, shm, CD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              SPLIT: tl.constexpr, H_MODE: tl.constexpr):
    """y = fp32(CD(acc)), then h += y in SPLIT column slices."""
    y = acc.to(CD).to(tl.float32)
    if SPLIT == 1:
        _add_slice(y, h_ptr, h_desc, m0, n0, M, N, shm, BM, BN, H_MODE)
    elif SPLIT == 2:
        y0, y1 = _halves(y, BM, BN)
        _add_slice(y0, h_ptr, h_desc, m0, n0, M, N, shm, BM, BN // 2, H_MODE)
        _add_slice(y1, h_ptr, h_desc, m0, n0 + BN // 2, M, N, shm, BM, BN // 2, H_MODE)
    else:
        y0, y1 = _halves(y, BM, BN)
        y00, y01 = _halves(y0, BM, BN // 2)
        y10, y11 = _halves(y1, BM, BN // 2)
        _add_slice(y00, h_ptr, h_desc, m0, n0, M, N, shm, BM, BN // 4, H_MODE)
        _add_slice(y01, h_ptr, h_desc, m0, n0 + BN // 4, M, N, shm, BM, BN // 4, H_MODE)
        _add_slice(y10, h_ptr, h_desc, m0, n0 + BN // 2, M, N, shm, BM, BN // 4, H_MODE)
        _add_slice(y11, h_ptr, h_desc, m0, n0 + 3 * (BN // 4), M, N, shm, BM, BN // 4, H_MODE)


@triton.jit
def _persistent_kernel(a_desc, w_desc, h_ptr, h_desc, a_ptr, w_ptr, M, N, K, sam, swn, shm, NPROG: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                       H_MODE: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr, DEV_DESC: tl.constexpr):
    """Grid = NPROG programs (one or two an SM); program p runs tiles p, p + NPROG, ... (row-major over N: a
    program's neighbours share its A rows). The epilogue's tile index is its own counter (as in Triton's tutorial
    09), so the pipeliner need not carry the main loop's across the epilogue. DEV_DESC: the descriptors built here
    (`tl.make_tensor_descriptor`, global scratch from `triton.set_allocator`) instead of the host's: the only way
    the Hopper warp specialization pass accepts a TMA h."""
    if DEV_DESC:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[sam, 1], block_shape=[BM, BK])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[swn, 1], block_shape=[BN, BK])
        h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, N], strides=[shm, 1], block_shape=[BM, BN // SPLIT])
    CD: tl.constexpr = a_desc.dtype
    start = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    tiles = tl.cdiv(M, BM) * tiles_n
    tile_c = start - NPROG
    for tile in tl.range(start, tiles, NPROG, flatten=FLATTEN, warp_specialize=WS):
        acc = _acc_tile(a_desc, w_desc, (tile // tiles_n) * BM, (tile % tiles_n) * BN, K, BM, BN, BK)
        tile_c += NPROG
        _epilogue(acc, h_ptr, h_desc, (tile_c // tiles_n) * BM, (tile_c % tiles_n) * BN, M, N, shm, CD, BM, BN,
                  SPLIT, H_MODE)


@triton.jit
def _tile_kernel(a_desc, w_desc, h_ptr, h_desc, M, N, K, shm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SPLIT: tl.constexpr, H_MODE: tl.constexpr):
    """One tile a program; program ids run down M first (neighbours share W's rows, as ours)."""
    CD: tl.constexpr = a_desc.dtype
    tiles_m = tl.cdiv(M, BM)
    pid = tl.program_id(0)
    m0 = (pid % tiles_m) * BM
    n0 = (pid // tiles_m) * BN
    acc = _acc_tile(a_desc, w_desc, m0, n0, K, BM, BN, BK)
    _epilogue(acc, h_ptr, h_desc, m0, n0, M, N, shm, CD, BM, BN, SPLIT, H_MODE)


@dataclass(frozen=True)
class Cand:
    name: str
    persistent: bool
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    split: int = 1              # epilogue column slices
    h_mode: int = H_PTR
    ws: bool = False            # tl.range(warp_specialize=True) on the tile loop
    flatten: bool = False       # tl.range(flatten=True) on the tile loop
    per_sm: int = 1             # persistent: programs per SM (grid = per_sm * SMs)
    dev_desc: bool = False      # persistent: descriptors made on the device
    maxnreg: int | None = None


# Registers and shared memory below: sm_90 compiles of these kernels by Triton 3.6.0 on a host without a GPU (ptxas
# of the wheel), M = 8,192, N = K = 1,024; ours: 124 registers, 96 KB (two programs an SM fit). "fit" is how many
# programs an SM holds by registers (64K), shared memory (228 KB) and warps. Order: plain kernels first, the
# experimental passes (flatten, then warp specialization) last, so that a hang (the watchdog ends the run) or a
# fault that kills the CUDA context costs only the lines after it.
CANDIDATES = [
    Cand("sub_t128x128_s2", False, 128, 128, 64, 8, 3, split=2),                           # 93 regs, 96K: fit 2
    Cand("sub_t128x128_s4", False, 128, 128, 64, 8, 3, split=4),                           # 90, 96K: 2
    Cand("sub_t128x128_s2_tmah", False, 128, 128, 64, 8, 3, split=2, h_mode=H_TMA),        # 91, 96K: 2
    Cand("sub_t128x128_s2_red", False, 128, 128, 64, 8, 3, split=2, h_mode=H_RED),         # 90, 96K: 2
    Cand("sub_t128x128_s4_red", False, 128, 128, 64, 8, 3, split=4, h_mode=H_RED),         # 90, 96K: 2
    Cand("sub_t128x256_s4_red", False, 128, 256, 64, 8, 3, split=4, h_mode=H_RED),         # 154, 144K: 1
    Cand("pers_p128x128", True, 128, 128, 64, 8, 3),                                       # 139, 96K: 1
    Cand("pers_p128x128_s2_red", True, 128, 128, 64, 8, 3, split=2, h_mode=H_RED),         # 90, 128K: 1
    Cand("flat_p128x128", True, 128, 128, 64, 8, 3, flatten=True),                         # 138, 112K: 1
    Cand("flat_p128x128_s4", True, 128, 128, 64, 8, 3, split=4, flatten=True),             # 112, 128K: 1
    Cand("flat2_p128x128_s4", True, 128, 128, 64, 8, 2, split=4, flatten=True, per_sm=2),  # 114, 96K: 2
    Cand("flat_p128x128_s2_tmah", True, 128, 128, 64, 8, 3, split=2, h_mode=H_TMA, flatten=True),  # 100, 160K: 1
    Cand("flat_p128x128_s4_red", True, 128, 128, 64, 8, 3, split=4, h_mode=H_RED, flatten=True),   # 90, 112K: 1
    Cand("flat2_p128x128_s4_red", True, 128, 128, 64, 8, 3, split=4, h_mode=H_RED, flatten=True, per_sm=2),  # 2
    Cand("flat2_p128x128_s4_red_st2", True, 128, 128, 64, 8, 2, split=4, h_mode=H_RED, flatten=True,
         per_sm=2),                                                                           # 90, 80K: 2
    Cand("flat_p128x256_s4_red", True, 128, 256, 64, 8, 3, split=4, h_mode=H_RED, flatten=True),   # 154, 176K: 1
    # Hopper warp specialization takes only num_warps=4 (8 warps: the attribute is dropped, a plain persistent
    # kernel), then runs 12 warps (a producer warpgroup, two consumers of 64 rows each). It fails to compile
    # ("PassManager::run failed") with any epilogue slicing (split > 1), with a TMA reduce, and with a TMA h
    # load/store through host descriptors (through descriptors made on the device it compiles: `_dtmah`).
    Cand("ws_p128x128_w4", True, 128, 128, 64, 4, 3, ws=True),                             # 168, 112K: 1
    Cand("ws_p128x128_w4_st4", True, 128, 128, 64, 4, 4, ws=True),                         # 168, 144K: 1
    Cand("ws_p128x256_w4", True, 128, 256, 64, 4, 3, ws=True),                             # 168, 176K: 1
    Cand("ws_p128x128_w4_dtmah", True, 128, 128, 64, 4, 3, h_mode=H_TMA, ws=True, dev_desc=True),  # 168, 160K: 1
]


def launch(c: Cand, a: torch.Tensor, w: torch.Tensor, h: torch.Tensor, sms: int):
    """h += a @ w.T by candidate c; returns what Triton's launch returned (the compiled kernel on a GPU)."""
    m, k = a.shape
    n = w.shape[0]
    a_d = TensorDescriptor(a, [m, k], [a.stride(0), 1], [c.bm, c.bk])
    w_d = TensorDescriptor(w, [n, k], [w.stride(0), 1], [c.bn, c.bk])
    h_d = TensorDescriptor(h, [m, n], [h.stride(0), 1], [c.bm, c.bn // c.split])
    opts = dict(num_warps=c.warps, num_stages=c.stages)
    if c.maxnreg is not None:
        opts["maxnreg"] = c.maxnreg
    if c.persistent:
        nprog = c.per_sm * sms
        return _persistent_kernel[(nprog,)](a_d, w_d, h, h_d, a, w, m, n, k, a.stride(0), w.stride(0), h.stride(0),
                                            NPROG=nprog, BM=c.bm, BN=c.bn, BK=c.bk, SPLIT=c.split, H_MODE=c.h_mode,
                                            WS=c.ws, FLATTEN=c.flatten, DEV_DESC=c.dev_desc, **opts)
    grid = (triton.cdiv(m, c.bm) * triton.cdiv(n, c.bn),)
    return _tile_kernel[grid](a_d, w_d, h, h_d, m, n, k, h.stride(0), BM=c.bm, BN=c.bn, BK=c.bk, SPLIT=c.split,
                              H_MODE=c.h_mode, **opts)


def fit_per_sm(regs: int, warps: int, smem: int) -> int:
    """Programs an H100/H200 SM holds: 64K registers (allocated 256 a warp at a time), 228 KB of shared memory (1 KB
    reserved a program), 64 warps."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    return min(65536 // (per_warp * warps), (228 * 1024) // (smem + 1024), 64 // warps)


def describe(compiled) -> str:
    """Registers, spills, warps, shared memory of a compiled kernel, programs an SM fits, and whether warp
    specialization took (`ttg.warp_specialize` in its TTGIR)."""
    try:
        compiled._init_handles()
        md = compiled.metadata
        ws = "ttg.warp_specialize" in compiled.asm.get("ttgir", "")
        fit = fit_per_sm(compiled.n_regs, md.num_warps, md.shared)
        return (f"regs={compiled.n_regs} spills={compiled.n_spills} warps={md.num_warps} smem={md.shared // 1024}K "
                f"fit={fit} ws={'yes' if ws else 'no'}")
    except Exception as e:      # the description is a courtesy; never let it cost the line
        return f"(no description: {type(e).__name__})"


def jit_compiled(fn) -> list:
    """Every kernel Triton's JIT compiled for `fn` in this process."""
    out = []
    for cache in getattr(fn, "device_caches", {}).values():
        out.extend(v for v in cache[0].values() if v is not None)
    return out


def graph_us(fn, calls: int = 20, samples: int = 30) -> tuple[float, str]:
    """p50 us per call of `fn`: a CUDA graph of `calls` back-to-back calls, timed with events `samples` times (plain
    launches if capture fails)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    how = "graph"
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        run = g.replay
    except Exception:
        how = "eager"

        def run():
            for _ in range(calls):
                fn()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1000.0 / calls)
    return statistics.median(times), how


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def make_inputs(m: int, n: int, k: int, device: str, dtype: torch.dtype, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(m, k, device=device, dtype=torch.float32, generator=g).to(dtype)
    w = (torch.randn(n, k, device=device, dtype=torch.float32, generator=g) / math.sqrt(k)).to(dtype)
    h = torch.randn(m, n, device=device, dtype=torch.float32, generator=g)
    return a, w, h


def _interpreter_reduce_add() -> None:
    """Triton's CPU interpreter has no descriptor reduce: emulate the add (load, fp32 add, store) so that the *_red
    candidates' indexing is checked too (not the hardware's atomics, nor their flush of subnormals)."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def create_descriptor_reduce(self, kind, desc, value, indices):
        ptrs, mask = desc.materialize_pointers(indices)
        old = self.create_masked_load(ptrs, mask, None, None, None, False)
        return self.create_masked_store(ptrs, TensorHandle(old.data + value.data, value.dtype), mask, None, None)

    if not hasattr(InterpreterBuilder, "create_descriptor_reduce"):
        InterpreterBuilder.create_descriptor_reduce = create_descriptor_reduce


def interpret_check(names: list[str]) -> None:
    """Triton's CPU interpreter, fp16 (it cannot multiply bf16): M = N = K = 128, then a shape of several tiles a
    program with ragged M and N edges; each candidate against our kernel under the same interpreter. Checks indexing,
    slices and the epilogue's arithmetic; warps, stages, warp specialization, flattening and maxnreg mean nothing
    here, and the TMA reduce is emulated (`_interpreter_reduce_add`)."""
    _interpreter_reduce_add()
    for m, n, k in ((128, 128, 128), (320, 384, 192)):
        a, w, h0 = make_inputs(m, n, k, "cpu", torch.float16, m + n + k)
        ref = h0.clone()
        residual(a, w, ref, None)
        exact = h0 + (a.float() @ w.float().T).to(torch.float16).float()
        print(f"interpret M={m} N={n} K={k}: ours against torch's fp32 product: max |diff| "
              f"{float((ref - exact).abs().max()):.3g}", flush=True)
        for c in CANDIDATES:
            if names and c.name not in names:
                continue
            h = h0.clone()
            try:
                launch(c, a, w, h, 4)
            except Exception as e:
                print(f"interpret {c.name:30s} failed: {first_line(e)}", flush=True)
                continue
            print(f"interpret {c.name:30s} bits={torch.equal(h, ref)} ndiff={int((h != ref).sum())}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    ap.add_argument("--shapes", default="1024x1024,1024x2624", help="NxK,...")
    ap.add_argument("--ms", default="1536,8192")
    ap.add_argument("--hang-s", type=float, default=90.0, help="watchdog per candidate and shape (compile included)")
    ap.add_argument("--interpret-check", action="store_true")
    args = ap.parse_args()
    names = [s for s in args.only.split(",") if s]
    if args.interpret_check:
        interpret_check(names)
        return
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)} sms={sms} torch {torch.__version__} triton {triton.__version__}",
          flush=True)

    def alloc_fn(size: int, alignment: int, stream):       # scratch for any descriptor Triton builds on the device
        return torch.empty(size, device="cuda", dtype=torch.int8)

    triton.set_allocator(alloc_fn)

    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(x) for x in args.ms.split(",")]
    cases = []
    ours_desc: dict = {}
    for n, k in shapes:
        for m in ms:
            a, w, h0 = make_inputs(m, n, k, "cuda", torch.bfloat16, 1000 * n + k + m)
            ref = h0.clone()
            before = {id(x) for x in jit_compiled(gm._gemm_kernel)}
            residual(a, w, ref, None)
            torch.cuda.synchronize()
            t = gm.fill_tiles(gm.pick_tiles(m, n, k, gm.Epi.RESIDUAL, sms), m, n, sms)
            new = [x for x in jit_compiled(gm._gemm_kernel) if id(x) not in before]
            if new:
                ours_desc[t] = describe(new[0])
            ht = h0.clone()
            ours, how_o = graph_us(lambda a=a, w=w, ht=ht: residual(a, w, ht, None))
            cub, how_c = graph_us(lambda a=a, w=w: torch.nn.functional.linear(a, w))
            print(f"{'ours':30s} N={n:5d} K={k:5d} M={m:5d} {ours:8.1f} us  x{ours / cub:5.2f} cuBLAS  "
                  f"tiles={t.bm}x{t.bn}x{t.bk} stages={t.stages} {ours_desc.get(t, '')} ({how_o})", flush=True)
            print(f"{'cublas_plain':30s} N={n:5d} K={k:5d} M={m:5d} {cub:8.1f} us  ({how_c})", flush=True)
            cases.append((n, k, m, a, w, h0, ref, ours, cub))

    for c in CANDIDATES:
        if names and c.name not in names:
            continue
        broken = None           # a compile error: the same for every shape, so said once
        for n, k, m, a, w, h0, ref, ours, cub in cases:
            head = f"{c.name:30s} N={n:5d} K={k:5d} M={m:5d}"
            if broken is not None:
                print(f"{head} failed: (as above) {broken}", flush=True)
                continue
            faulthandler.dump_traceback_later(args.hang_s, exit=True)
            try:
                h = h0.clone()
                compiled = launch(c, a, w, h, sms)
                torch.cuda.synchronize()
                same = torch.equal(h, ref)
                bits = "True" if same else f"False ndiff={int((h != ref).sum())}"
                ht = h0.clone()
                us, how = graph_us(lambda c=c, a=a, w=w, ht=ht: launch(c, a, w, ht, sms))
                print(f"{head} {us:8.1f} us  x{us / cub:5.2f} cuBLAS  x{us / ours:5.2f} ours  bits={bits}  "
                      f"{describe(compiled)} ({how})", flush=True)
            except Exception as e:
                print(f"{head} failed: {first_line(e)}", flush=True)
                if isinstance(e, triton.CompilationError) or "PassManager" in str(e) or "ptxas" in str(e):
                    broken = type(e).__name__
                if "CUDA" in str(e) and ("illegal" in str(e) or "launch failure" in str(e)):
                    print("the CUDA context is gone; stopping", flush=True)
                    return
            finally:
                faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
