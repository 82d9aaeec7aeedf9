"""The fast path's GEMM: batch-invariant, M-adaptive, with the work between GEMMs fused into its epilogue.

Batch invariance. Every output element is accumulated over K in one order: k-steps of 16 in ascending k,
each a tensor-core MMA into one fp32 accumulator that starts at zero (per K chunk, see below). Tile shapes in
M and N, the K tile (how many 16-steps one loop iteration issues), warps and pipeline stages change with M,
because none of them changes that chain; the K split never changes with M (it is fixed by K alone: `k_chunk`).
Whether the hardware keeps its promise for every configuration this module picks is not taken on trust: a
device probe ran each (N, K) of the large checkpoint at every configuration and compared rows bit for bit. All
configurations keep BM >= 64 and 4 or 8 warps, so every one of them issues the same warpgroup MMA instruction
(wgmma on Hopper).

K chunks (`k_chunk`, opt-in: LAYA_K_CHUNKS=1; one chain is the default, and `fill_tiles` narrows the tiles of small
M instead). A residual GEMM whose N is the hidden size has too few output tiles to keep the SMs busy at
small M (1024 columns in tiles of 16-32: 32-64 programs on 132 SMs). Its K is therefore cut into two fixed chunks,
chosen from K alone: each chunk is its own MMA chain from zero, and the two sums are added in fp32, c0 + c1. At
small M each chunk runs in its own program and writes its sum to a workspace, and the row kernel that next reads
the residual stream (kernels/rows.py) adds them and finishes the epilogue; at large M one program runs both chains
side by side in one loop and finishes itself. Both are the same additions of the same values, so both give the
same bits, and which one runs (by M) changes nothing.

Epilogues (`Epi`), each rounding where the SDK's op-by-op bf16 forward rounds:
- PLAIN: y = bf16(acc [+ bias]) [-> bf16(act(y))]; `bias_apart` rounds acc before adding the bias (torch's
  unfused matmul + add that the SDK's decision head takes).
- RESIDUAL: h += fp32(y) on an fp32 residual stream, in place (each element has one writer).
- GEGLU: the program computes the input column n and its gate column n + N/2 together and writes
  bf16(bf16(gelu(bf16(inp))) * bf16(gate)), so the [T, 2F] product never reaches memory.
- GEGLU_PAIRS (the forward's): GEGLU on w in `geglu_pairs` order (input row f, gate row f, ...), so one accumulator
  and one weight tile hold both columns of a pair, one thread's neighbours (as ROPE's pairs): the same bits, 7-9% less
  time at M = 8,192 and 3-7% at M = 48 (H200, H100; docs/PERF.md, twenty-fourth session). GEGLU stays as the form
  whose bits it matches (tests/test_gemm_gpu.py) and for LAYA_GEGLU=two.
- ROPE: w's rows in `rope_pairs` order, so each column c < D/2 of a head and its partner c + D/2 are neighbours
  in one tile and in one thread's accumulator: a plain one-accumulator GEMM (any tile) whose epilogue rotates query
  and key heads by their row-relative position (cos/sin tables in fp32, the rotate-half layout) and writes both
  columns back to their own places; value heads pass through. (Until 2026-12-04 the program ran the partner
  columns as a second accumulator over a second read of W, which cost 1.6x cuBLAS's time at M = 8,192.)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .exact import gelu_table, needs_table
from .launch import (
    cached,
    compile_launch,
    current_device,
    env,
    keep,
    launch,
    on_forget,
    prefetching,
    settle_keys,
    sms,
    through_triton,
)
from .launch import switches as launch_switches

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .exact import gelu as _gelu
    from .exact import mul as _mul
    from .launch import prefetch, wait_turn
except ImportError:  # CPU-only installs have no Triton; only the CUDA path needs it
    triton = TensorDescriptor = None


class Epi(enum.IntEnum):
    PLAIN = 0
    RESIDUAL = 1
    GEGLU = 2
    ROPE = 3
    GEGLU_PAIRS = 4


class Act(enum.IntEnum):
    NONE = 0
    GELU = 1
    RELU = 2


@dataclass(frozen=True)
class Tiles:
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int


def pick_tiles(m: int, n_out: int, k: int, epi: Epi, sms: int = 132) -> Tiles:
    """Tile shapes for an (M, N, K) product; pure, so it is tested alone.

    Small M is weight-bandwidth bound: narrow N tiles give enough programs to keep the SMs streaming weights,
    and deep K tiles keep enough bytes in flight. Large M is compute bound: 128-wide tiles. `n_out` counts
    the programs' output columns (paired epilogues compute two columns per output column).
    """
    if epi == Epi.GEGLU_PAIRS:
        # One accumulator over interleaved (input, gate) rows; BN counts both. Device sweep (probe_geglu.py, H100,
        # twenty-fourth session), us a GEMM with its weights cold: M = 48 7.36 against 7.88 for two accumulators,
        # M = 128 8.99 / 9.71, M = 1,536 30.3 / 31.3, M = 8,192 159.5 / 171.3.
        if m <= 64:
            return Tiles(64, 64, 128 if k >= 128 else 64, 4, 4)
        if m <= 512:
            return Tiles(64, 32, 64, 4, 4)
        return Tiles(128, 128, 64, 8, 3)
    paired = epi == Epi.GEGLU
    if m <= 64:
        bm, warps = 64, 4
        bn = 16 if paired else 32
        while bn < 64 and (n_out // bn) > 2 * sms:
            bn *= 2
        if epi == Epi.GEGLU:
            # 32-wide pairs, three stages: 5.2 us against 7.4 for 16-wide at M=48, N=2x2624 (device sweep,
            # probe_fast.py tiles step, 2026-12-03); a 16-wide tiling leaves 164 programs for 132 SMs.
            return Tiles(bm, 32, 128 if k >= 128 else 64, warps, 3)
        return Tiles(bm, bn, 128 if k >= 128 else 64, warps, 4)
    if m <= 512:
        bn = 32 if paired else 64
        return Tiles(64, bn, 64, 4, 4)
    if paired:
        return Tiles(128, 64, 64, 8, 3)
    return Tiles(128, 128, 64, 8, 3)


def fill_tiles(t: Tiles, m: int, n_out: int, sms: int) -> Tiles:
    """Smaller output tiles until a GEMM's programs cover the SMs: a residual GEMM's N is the hidden size, whose
    1024 columns in 128-wide tiles leave SMs idle up to M ~ 2,000 (and at small M in any tiling). Tiles never change
    the bits, so this is free to depend on M. Order: N to 64, then M to 64 (one warpgroup), then N to 16.

    Tried and dropped (2026-12-04, thirteenth session): stopping at one wave from M = 1,024 on. Alone, a 128x128
    residual GEMM at M = 1,536 (96 programs) beat 128x64 (192) by 12-26%; in a forward the single-wave grid is
    launched early under PDL (kernels/launch.py) and its waiting blocks hold SMs the kernels before it need: 32x48
    3.91 ms against 3.60, 4x256 2.97 against 2.64 (same call)."""
    def programs(t: Tiles) -> int:
        return -(-m // t.bm) * -(-n_out // t.bn)
    while programs(t) < sms:
        if t.bn > 64:
            t = Tiles(t.bm, t.bn // 2, t.bk, t.warps, t.stages)
        elif t.bm > 64:
            t = Tiles(64, t.bn, t.bk, 4, max(t.stages, 4))
        elif t.bn > 16:
            t = Tiles(t.bm, t.bn // 2, t.bk, t.warps, t.stages)
        else:
            break
    return t


if triton is not None:
    @triton.jit
    def _finish(acc, bias_ptr, table_ptr, cols, col_ok, CD: tl.constexpr, HAS_BIAS: tl.constexpr,
                BIAS_APART: tl.constexpr, ACT: tl.constexpr, TABLE: tl.constexpr):
        """acc (fp32) -> a CD (compute dtype) value held in fp32: bias, rounding and activation where torch
        rounds."""
        if HAS_BIAS:
            b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if BIAS_APART:
                acc = acc.to(CD).to(tl.float32) + b
            else:
                acc = acc + b
        y = acc.to(CD).to(tl.float32)
        if ACT == 1:
            y = _gelu(y, table_ptr, TABLE).to(CD).to(tl.float32)
        elif ACT == 2:
            y = tl.maximum(y, 0.0)
        return y

    @triton.jit
    def _rope_tables(pos_ptr, cos_ptr, sin_ptr, rm, row_ok, pid_n, N_OUT, ROPE_HEADS, HALF: tl.constexpr,
                     BN: tl.constexpr):
        """cos and sin [BM, BN / 2] of a ROPE program's pairs (1 and 0 where a pair does not rotate)."""
        pair = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        rot = row_ok[:, None] & (pair < N_OUT // 2)[None, :] & (pair // HALF < ROPE_HEADS)[None, :]
        pos = tl.load(pos_ptr + rm, mask=row_ok, other=0)
        t = pos[:, None] * HALF + (pair % HALF)[None, :]
        return tl.load(cos_ptr + t, mask=rot, other=1.0), tl.load(sin_ptr + t, mask=rot, other=0.0)

    @triton.jit
    def _gemm_kernel(a_ptr, w_ptr, bias_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, table_ptr,
                     M, N_OUT, K, sam, swn, som, PARTNER, ROPE_HEADS, CHUNKS, sps,
                     EPI: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_APART: tl.constexpr, ACT: tl.constexpr,
                     HALF: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     TMA: tl.constexpr, USE_GDC: tl.constexpr, CHUNK: tl.constexpr = 0, SPLIT: tl.constexpr = False,
                     GELU_TABLE: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                     W_BYTES: tl.constexpr = 2, PIECES: tl.constexpr = 128, EARLY: tl.constexpr = False):
        # TMA: a_ptr and w_ptr are tensor descriptors (blocks [BM, BK] and [BN, BK]) and the copy engine
        # loads the tiles; the MMA chain is the same, so are the bits (the device probe checks it).
        CD: tl.constexpr = bias_ptr.dtype.element_ty    # the compute dtype (bias_ptr is w itself without a bias)
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        if PREFETCH:
            # This program's weight rows (contiguous: w is [N, K]) into L2 while the kernels before it finish
            # (kernels/launch.py); one row block of programs asks, the others read the same rows.
            if pid_m == 0:
                nbytes = tl.minimum(BN, N_OUT - pid_n * BN) * K * W_BYTES
                prefetch(w_ptr + pid_n * BN * swn, nbytes, PIECES)
                if EPI == 2:
                    prefetch(w_ptr + (PARTNER + pid_n * BN) * swn, nbytes, PIECES)
        wait_turn(USE_GDC)
        rm = pid_m * BM + tl.arange(0, BM)
        rk = tl.arange(0, BK)
        cols = pid_n * BN + tl.arange(0, BN)
        col_ok = cols < N_OUT
        row_ok = rm < M
        if EARLY:
            # The epilogue's operands read before the K loop, so their latency hides behind it (`early_epilogue`):
            # the residual tile, or the RoPE tables. After wait_turn: h is an activation.
            if EPI == 1 and not SPLIT:
                h_early = tl.load(out_ptr + rm[:, None] * som + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                                  other=0.0)
            if EPI == 3:
                c_early, s_early = _rope_tables(pos_ptr, cos_ptr, sin_ptr, rm, row_ok, pid_n, N_OUT, ROPE_HEADS,
                                                HALF, BN)
        if CHUNK > 0:
            # K in two fixed chunks (module docstring). SPLIT: this program runs chunk program_id(2) alone and
            # leaves its sum in the workspace `out_ptr` [2, M, N_OUT]. Otherwise one loop runs both chains side by
            # side (chunk 1's tail past K reads zeros, which add nothing) and adds them: c0 + c1.
            if SPLIT:
                first = tl.program_id(2)
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                k_hi = tl.minimum(K, (first + 1) * CHUNK)
                for k0 in range(first * CHUNK, k_hi, BK):
                    if TMA:
                        acc = tl.dot(a_ptr.load([pid_m * BM, k0]), w_ptr.load([tl.min(cols, 0), k0]).T, acc)
                    else:
                        kk = k0 + rk
                        k_ok = kk < k_hi
                        a = tl.load(a_ptr + rm[:, None] * sam + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                                    other=0.0)
                        b = tl.load(w_ptr + cols[None, :] * swn + kk[:, None], mask=col_ok[None, :] & k_ok[:, None],
                                    other=0.0)
                        acc = tl.dot(a, b, acc)
            else:
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                acc1 = tl.zeros((BM, BN), dtype=tl.float32)
                for k0 in range(0, CHUNK, BK):
                    if TMA:     # chunk edges are whole BK tiles; past K the copy engine fills zeros
                        n0 = tl.min(cols, 0)
                        acc = tl.dot(a_ptr.load([pid_m * BM, k0]), w_ptr.load([n0, k0]).T, acc)
                        acc1 = tl.dot(a_ptr.load([pid_m * BM, CHUNK + k0]), w_ptr.load([n0, CHUNK + k0]).T, acc1)
                    else:
                        kk = k0 + rk
                        a = tl.load(a_ptr + rm[:, None] * sam + kk[None, :], mask=row_ok[:, None], other=0.0)
                        b = tl.load(w_ptr + cols[None, :] * swn + kk[:, None], mask=col_ok[None, :], other=0.0)
                        acc = tl.dot(a, b, acc)
                        k1 = CHUNK + kk
                        k1_ok = k1 < K
                        a1 = tl.load(a_ptr + rm[:, None] * sam + k1[None, :], mask=row_ok[:, None] & k1_ok[None, :],
                                     other=0.0)
                        b1 = tl.load(w_ptr + cols[None, :] * swn + k1[:, None], mask=col_ok[None, :] & k1_ok[:, None],
                                     other=0.0)
                        acc1 = tl.dot(a1, b1, acc1)
                acc = acc + acc1
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if EPI == 2:
                acc2 = tl.zeros((BM, BN), dtype=tl.float32)
            if TMA:
                n0 = tl.min(cols, 0)
                for k0 in range(0, K, BK):
                    a = a_ptr.load([pid_m * BM, k0])
                    acc = tl.dot(a, w_ptr.load([n0, k0]).T, acc)
                    if EPI == 2:
                        acc2 = tl.dot(a, w_ptr.load([n0 + PARTNER, k0]).T, acc2)
            else:
                a_ptrs = a_ptr + rm[:, None] * sam + rk[None, :]
                w_ptrs = w_ptr + cols[None, :] * swn + rk[:, None]
                for k0 in range(0, K, BK):
                    k_ok = (k0 + rk) < K
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    b = tl.load(w_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
                    acc = tl.dot(a, b, acc)
                    if EPI == 2:
                        b2 = tl.load(w_ptrs + PARTNER * swn, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
                        acc2 = tl.dot(a, b2, acc2)
                    a_ptrs += BK
                    w_ptrs += BK
        out_ptrs = out_ptr + rm[:, None] * som + cols[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        if SPLIT:
            tl.store(out_ptrs + first.to(tl.int64) * sps, acc, mask=ok)
        elif EPI == 0:
            y = _finish(acc, bias_ptr, table_ptr, cols, col_ok, CD, HAS_BIAS, BIAS_APART, ACT, GELU_TABLE)
            tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=ok)
        elif EPI == 1:
            y = _finish(acc, bias_ptr, table_ptr, cols, col_ok, CD, HAS_BIAS, BIAS_APART, ACT, GELU_TABLE)
            if EARLY:
                h = h_early
            else:
                h = tl.load(out_ptrs, mask=ok, other=0.0)
            tl.store(out_ptrs, h + y, mask=ok)
        elif EPI == 2:
            inp = acc.to(CD).to(tl.float32)
            gate = acc2.to(CD).to(tl.float32)
            g = _gelu(inp, table_ptr, GELU_TABLE).to(CD).to(tl.float32)
            tl.store(out_ptrs, (g * gate).to(out_ptr.dtype.element_ty), mask=ok)
        elif EPI == 4:
            # w in `geglu_pairs` order: columns 2p and 2p + 1 are output column p's input and gate, one thread's
            # neighbours in the accumulator (as ROPE's pairs), so one product and one weight tile serve both.
            inp, gate = tl.split(tl.reshape(acc.to(CD).to(tl.float32), (BM, BN // 2, 2)))
            pair = pid_n * (BN // 2) + tl.arange(0, BN // 2)
            pair_ok = row_ok[:, None] & (pair < N_OUT // 2)[None, :]
            g = _gelu(inp, table_ptr, GELU_TABLE).to(CD).to(tl.float32)
            tl.store(out_ptr + rm[:, None] * som + pair[None, :], (g * gate).to(out_ptr.dtype.element_ty),
                     mask=pair_ok)
        else:
            # w in `rope_pairs` order: columns 2p and 2p + 1 are pair p's (x1, x2), one thread's neighbours in the
            # accumulator, so the split moves no data; pair p is column j = p % HALF of head p // HALF and its
            # partner, HALF on. Query and key heads (the first ROPE_HEADS) rotate by the token's row-relative
            # position; value heads pass through.
            x1, x2 = tl.split(tl.reshape(acc.to(CD).to(tl.float32), (BM, BN // 2, 2)))
            pair = pid_n * (BN // 2) + tl.arange(0, BN // 2)
            head = pair // HALF
            j = pair % HALF
            pair_ok = row_ok[:, None] & (pair < N_OUT // 2)[None, :]
            rot = pair_ok & (head < ROPE_HEADS)[None, :]
            if EARLY:
                c, s = c_early, s_early
            else:
                c, s = _rope_tables(pos_ptr, cos_ptr, sin_ptr, rm, row_ok, pid_n, N_OUT, ROPE_HEADS, HALF, BN)
            # torch's x * cos + rotate_half(x) * sin: each product rounded, then the sum
            y1 = tl.where(rot, _mul(x1, c) - _mul(x2, s), x1)
            y2 = tl.where(rot, _mul(x2, c) + _mul(x1, s), x2)
            first = out_ptr + rm[:, None] * som + (head * (2 * HALF) + j)[None, :]
            tl.store(first, y1.to(out_ptr.dtype.element_ty), mask=pair_ok)
            tl.store(first + HALF, y2.to(out_ptr.dtype.element_ty), mask=pair_ok)


def gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, epi: Epi = Epi.PLAIN,
         bias: torch.Tensor | None = None, bias_apart: bool = False, act: Act = Act.NONE,
         rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None = None,
         tiles: Tiles | None = None, tma: bool | None = None, chunk: int | None = None) -> torch.Tensor:
    """out <- epilogue(a @ w.T). a [M, K] bf16 (row stride free, unit column stride), w [N, K] contiguous.

    PLAIN: out [M, N] bf16. RESIDUAL: out [M, N] fp32, added to. GEGLU: w holds [inp; gate] (N = 2F),
    out [M, F]; GEGLU_PAIRS: the same with w in `geglu_pairs` order. ROPE: w in `rope_pairs(w, D)` order;
    `rope=(pos [M] int32, cos [P, D/2] fp32, sin, D, rope_heads)`: out [M, N] in w's own column order (before
    `rope_pairs`); the first `rope_heads` heads of D columns are rotated (query and key), the rest pass through.
    `chunk`: K per chunk (default `k_chunk`; 0 for one chain), residual GEMMs only.
    """
    _launch(a, w, out, epi, bias, bias_apart, act, rope, tiles, tma, chunk, None)
    return out


def rope_pairs(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """w's rows reordered for the ROPE epilogue: in each head of `head_dim` rows, row j < D/2 and its partner
    j + D/2 side by side. Reordering rows moves whole dot products, never their K order: the same bits."""
    n, k = w.shape
    half = head_dim // 2
    return w.view(n // head_dim, 2, half, k).transpose(1, 2).reshape(n, k).contiguous()


def geglu_pairs(w: torch.Tensor) -> torch.Tensor:
    """Wi's rows [input; gate] (2F, K) interleaved for the GEGLU_PAIRS epilogue: input row f, then gate row f.
    Reordering rows moves whole dot products, never their K order: the same bits as GEGLU on the rows as they were."""
    n, k = w.shape
    return w.view(2, n // 2, k).transpose(0, 1).reshape(n, k).contiguous()


@dataclass
class Pending:
    """The chunk sums a split residual GEMM left in `parts` [chunks, M, N] for the next row kernel, which adds
    them in order, finishes the epilogue (bias, rounding) and adds the result to the residual stream."""
    parts: torch.Tensor
    chunks: int
    bias: torch.Tensor | None
    bias_apart: bool


def residual(a: torch.Tensor, w: torch.Tensor, h: torch.Tensor, parts: torch.Tensor | None, *,
             bias: torch.Tensor | None = None, bias_apart: bool = False, split: bool | None = None,
             chunk: int | None = None, tiles: Tiles | None = None, tma: bool | None = None) -> Pending | None:
    """h += a @ w.T (+ bias), or, when K is chunked and too few output tiles would keep the SMs busy (or
    `split=True`), run one program per chunk into `parts` and return what the next row kernel must add. The
    bits are the same either way (module docstring)."""
    m, k = a.shape
    c = k_chunk(k) if chunk is None else chunk
    chunks = 2 if c else 1
    if split is None:
        t = tiles or pick_tiles(m, w.shape[0], k, Epi.RESIDUAL, sms(a.device))
        split = (parts is not None and chunks > 1 and m <= SPLIT_MAX_M
                 and triton.cdiv(m, t.bm) * triton.cdiv(w.shape[0], t.bn) < sms(a.device))
    if not split:
        _launch(a, w, h, Epi.RESIDUAL, bias, bias_apart, Act.NONE, None, tiles, tma, c, None)
        return None
    assert chunks > 1 and parts is not None and parts.shape[0] >= chunks and parts.dtype == torch.float32
    view = parts[:chunks, :m, : w.shape[0]]
    _launch(a, w, view, Epi.RESIDUAL, bias, bias_apart, Act.NONE, None, tiles, tma, c, view.stride(0))
    return Pending(view, chunks, bias, bias_apart)


SPLIT_MAX_M = 2048        # beyond it the chunk sums' round trip through memory costs more than idle SMs


def k_chunk(k: int) -> int:
    """K of a residual GEMM's first chunk (0: one chain over all of K); the second chunk is the rest. A function of K
    alone, never of M or of the device, so every worker and every batch reduces the same chunks in the same order.
    Two chunks: enough programs at small M (1024 columns in tiles of 16, twice), and the unsplit kernel runs both
    chains in one loop, so large M pays only a second accumulator."""
    if k < 1024 or env("LAYA_K_CHUNKS") != "1":
        # One chain, the default since 2026-12-04: cuBLAS's order at the M the SDK runs (a few hundred tokens and
        # up), so the residual GEMMs give the SDK's bits (probe_parity's gemm_residual: 5.1e-4 of outputs differed
        # with chunks, 0 without); `fill_tiles` gives small M its programs back. LAYA_K_CHUNKS=1: two chunks.
        return 0
    return -(-k // 256) * 128          # half of K, rounded up to whole K tiles of 128


def split_tiles(t: Tiles, m: int, n_out: int, chunks: int, sms: int) -> Tiles:
    """Narrower N tiles until a split GEMM's chunk programs fill the SMs (tiles never change the bits)."""
    while t.bn > 16 and -(-m // t.bm) * -(-n_out // t.bn) * chunks < sms:
        t = Tiles(t.bm, t.bn // 2, t.bk, t.warps, t.stages)
    return t


# A GEMM launch made once, by its call's shapes, strides, dtypes, alignments, options and switches (`_plan_key`):
# the compiled kernel, its grid, its integer arguments, the TMA blocks (None: pointers) and the GELU table, so that a
# launch of the same kind skips the tile choice and Triton's dispatch (kernels/launch.py `dispatch`: why).
_PLANS: dict[tuple, tuple] = {}
_MAX_PLANS = 2048          # eager mode meets a new M on every request: a bound, then start again
on_forget(_PLANS.clear)


def _aligned(t) -> bool:
    return t.data_ptr() % 16 == 0


def _plan_key(a, w, out, epi, bias, bias_apart, act, rope, tiles, tma, chunk, split_stride) -> tuple:
    """What `_launch` decides from through its arguments and the environment (shapes, strides, dtypes, 16-byte
    alignments, options, the LAYA_* switches, the current device), which covers what Triton specializes the launch
    on. Not in it: this module's functions and constants (pick_tiles, fill_tiles, TMA_MIN_M, ...) and the GELU
    decision of `exact.prepare`: whoever changes those between launches calls `launch.forget()`. A hit skips
    `_launch`'s checks of its arguments: the strides it checks are in the key, so a hit has passed them once."""
    r = None if rope is None else (rope[3], rope[4], rope[0].dtype, rope[1].dtype, rope[2].dtype, _aligned(rope[0]),
                                   _aligned(rope[1]), _aligned(rope[2]))
    b = None if bias is None else (bias.dtype, _aligned(bias))
    return (a.shape, a.stride(), a.dtype, _aligned(a), w.shape, w.stride(), w.dtype, _aligned(w), out.shape,
            out.stride(), out.dtype, _aligned(out), b, r, epi, act, bias_apart, tiles, tma, chunk, split_stride,
            current_device(), launch_switches())


def _launch(a, w, out, epi: Epi, bias, bias_apart: bool, act: Act, rope, tiles: Tiles | None, tma: bool | None,
            chunk: int | None, split_stride: int | None) -> None:
    key = None
    if cached(a.device):
        key = _plan_key(a, w, out, epi, bias, bias_apart, act, rope, tiles, tma, chunk, split_stride)
        plan = _PLANS.get(key)
        if plan is not None:
            compiled, grid, ints, blocks, table = plan
            compiled(grid, _pointers(a, w, out, bias, rope, blocks, table) + ints)
            return
    m, k = a.shape
    n = w.shape[0]
    assert a.stride(1) == 1 and w.is_contiguous() and out.stride(-1) == 1 and w.shape[1] == k
    n_out = n // 2 if epi in (Epi.GEGLU, Epi.GEGLU_PAIRS) else n
    if epi == Epi.RESIDUAL:
        assert out.dtype == torch.float32
    assert epi not in (Epi.GEGLU, Epi.GEGLU_PAIRS) or (bias is None and act == Act.NONE), "GeGLU: no bias, no act"
    chunk = (k_chunk(k) if chunk is None else chunk) if epi == Epi.RESIDUAL else 0
    chunks = 2 if chunk else 1
    assert not chunk or chunk < k <= 2 * chunk, (chunk, k)
    split = split_stride is not None
    t = tiles or pick_tiles(m, n_out, k, epi, sms(a.device))
    half, partner, rope_heads = 1, 0, 0
    if epi == Epi.GEGLU:
        partner = n_out
        programs_n = triton.cdiv(n_out, t.bn)
    elif epi == Epi.GEGLU_PAIRS:
        assert t.bn % 2 == 0, t
        programs_n = triton.cdiv(n, t.bn)
    elif epi == Epi.ROPE:
        d, rope_heads = rope[3:]
        half = d // 2
        assert n % d == 0 and t.bn % 2 == 0, (d, t)
        programs_n = triton.cdiv(n, t.bn)
    else:
        if split and tiles is None:
            t = split_tiles(t, m, n_out, chunks, sms(a.device))
        elif epi == Epi.RESIDUAL and tiles is None:
            t = fill_tiles(t, m, n_out, sms(a.device))
        programs_n = triton.cdiv(n_out, t.bn)
    assert not chunk or chunk % t.bk == 0, (chunk, t)      # chunk edges on whole K tiles (TMA reads no neighbour)
    grid = (triton.cdiv(m, t.bm), programs_n, chunks if split else 1)
    if tma is None:
        tma = use_tma(m, a, w)
    blocks = ([t.bm, t.bk], [t.bn, t.bk]) if tma else None
    out_rows = out.stride(-2) if out.dim() == 3 else out.stride(0)
    gelu = epi in (Epi.GEGLU, Epi.GEGLU_PAIRS) or act == Act.GELU
    table = gelu_table(a.device) if gelu else None
    options = launch(a.device, grid[0] * grid[1] * grid[2])
    ahead = prefetching(options) and not tma and w.data_ptr() % 16 == 0 and (k * w.element_size()) % 16 == 0
    args = _pointers(a, w, out, bias, rope, blocks, table)
    # the kernel's N_OUT: its weight rows where the epilogue pairs columns (ROPE, GEGLU_PAIRS), else output columns
    n_kernel = n if epi in (Epi.ROPE, Epi.GEGLU_PAIRS) else n_out
    ints = (m, n_kernel, k, a.stride(0), w.stride(0), out_rows, partner, rope_heads, chunks, split_stride or 0)
    kwargs = dict(EPI=int(epi), HAS_BIAS=bias is not None, BIAS_APART=bias_apart, ACT=int(act),
                  HALF=half, BM=t.bm, BN=t.bn, BK=t.bk, TMA=tma, CHUNK=chunk, SPLIT=split,
                  GELU_TABLE=gelu and needs_table(a.device), PREFETCH=ahead, W_BYTES=w.element_size(),
                  PIECES=32 * t.warps, EARLY=early_epilogue(m, epi), **options,
                  num_warps=t.warps, num_stages=t.stages)
    if key is None:
        through_triton(_gemm_kernel, grid, args + ints, kwargs)
        return
    compiled = compile_launch(_gemm_kernel, grid, args + ints, kwargs)
    if compiled is not None:
        keep(_PLANS, key, (compiled, grid, ints, blocks, table), _MAX_PLANS)


def _pointers(a, w, out, bias, rope, blocks, table) -> tuple:
    """`_gemm_kernel`'s eight tensor arguments: a and w as themselves or (`blocks`: their TMA blocks) as tensor
    descriptors; w itself where an operand is absent (never read: its flag is off)."""
    if blocks is not None:
        a = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], blocks[0])
        w_arg = TensorDescriptor(w, list(w.shape), [w.stride(0), 1], blocks[1])
    else:
        w_arg = w
    pos, cos, sin = rope[:3] if rope is not None else (w, w, w)
    return (a, w_arg, bias if bias is not None else w, out, pos, cos, sin, table if table is not None else w)


# Device run of 2026-12-04 (fifteenth session, call 2), graph replay with every GEMM's epilogue operands read before
# its K loop against after it: 1x48 0.945 against 0.973 ms, 32x48 3.623 / 3.593, 4x256 2.753 / 2.632, 16x512 16.82 /
# 14.87 (a 128x128 tile holding its residual tile through the loop spills); same bits at every shape.
EARLY_MAX_M = 64


def early_epilogue(m: int, epi: Epi) -> bool:
    """Whether a GEMM of M rows reads its epilogue's operands before its K loop (LAYA_EARLY_EPI=1: always, 0: never,
    rope: the RoPE tables at every M, whose [BM, BN/2] fp32 pair is half a residual tile's registers)."""
    forced = env("LAYA_EARLY_EPI")
    if forced in ("0", "1"):
        return forced == "1"
    return m <= EARLY_MAX_M or (forced == "rope" and epi == Epi.ROPE)


TMA_MIN_M = 1024          # device probe (eleventh session): TMA 20-40% faster a GEMM at M=1,536; LAYA_TMA=0: off


def use_tma(m: int, a: torch.Tensor, w: torch.Tensor) -> bool:
    """The copy engine for the operands when M is large and the operands meet its 16-byte rules."""
    if TensorDescriptor is None or a.device.type != "cuda" or m < TMA_MIN_M or env("LAYA_TMA") == "0":
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (a, w))


# Every Triton function's cache key now, in definition order (launch.settle_keys says why).
settle_keys(globals())
