"""Row kernels of the fast path: one program per token (or per request row), one reduction per row.

Each row is reduced in one fixed order over a block as wide as the hidden size, so a token's result never
depends on the batch. LayerNorms run in fp32 on the fp32 residual stream, as the SDK's autocast does, and
write bf16 where the next op is a GEMM.

- `embed`: packed ids -> token row and row-relative position, embedding gather, embedding LayerNorm;
  writes the fp32 residual h, its bf16 copy for layer 0 (which has no attention norm) and pos/row.
- `layer_norm`: h -> bf16 LN(h).
- `layer_norm` and `head_entry` first finish a split residual GEMM when given its `Pending` (kernels/gemm.py): add
  its chunk sums in chunk order, run its epilogue (bias, rounding to bf16) and add the result to h, exactly the
  operations the GEMM's own epilogue runs when it does not split.
- `head_entry`: h <- LN_final(h) + type_emb[type of the token's row]; x <- bf16 LN_1(h) (the head's first norm).
- `gather_norm`: the scorer's LayerNorm of h at each row's [MASK] markers.
- `features`: the logits of a row's markers, their softmax's confidence features and the act head's input.
- `softmax_rows`: fp32 softmax of the act head's bf16 logits.

LayerNorms give torch's bits (the SDK's, and the worker path's `F.layer_norm`): a one-pass order of our own
differed from torch's in ~2e-5 of outputs, and over 28 layers such ulps move answers (docs/PERF.md, "parity").
torch's vectorized kernel (aten/src/ATen/native/cuda/layer_norm_kernel.cu) runs 128 threads, each reading float4s
at lane, lane + 128, ...; each lane folds its values in read order (Welford, `cuWelfordOnlineSum`), lanes merge by
a shuffle-down tree and then a tree over the four warps (`cuWelfordCombine`); nvcc fuses the multiply-adds that
`fma` and `_mul` (a product rounded on its own) spell out here. A row is held as [S / 4, LANES, 4], each lane's
float4s in its own thread, folded there in order; one tl.reduce over the [LANES] states then runs Triton's shuffles
and its tree over the warps, which for lane 0 is torch's tree. Device runs of 2026-12-04: 0 fp32 outputs differ
from F.layer_norm on every case of the device's row probe and on its parity probe's row; 0.0059 / 0.0088 /
0.020 ms at 48 / 1,536 / 8,192 rows against torch's 0.0070 / 0.0104 / 0.032. Two earlier orders are gone: one
tl.reduce over the whole row (fast, but ~2e-5 of outputs another bit: Triton's in-thread order is not torch's
there) and the tree spelled out with splits (exact, 3.6x slower than torch).
"""
from __future__ import annotations

from .launch import dispatch, launch, settle_keys

try:
    import triton
    import triton.language as tl

    from .exact import mul as _mul
    from .exact import rsqrt as _rsqrt
    from .launch import wait_turn
except ImportError:  # CPU-only installs have no Triton; only the CUDA path needs it
    triton = None

LANES = 128         # torch's vectorized LayerNorm: one block of 32 x 4 threads per row
MAX_WIDTH = 1024    # rows held as [1 or 2, LANES, 4]: at most two float4 reads per lane

if triton is not None:
    _LANES = tl.constexpr(LANES)

    @triton.jit
    def _online(mean, m2, count, val, ok):
        """One value into each lane's running (mean, M2, count) where `ok`: torch's cuWelfordOnlineSum."""
        delta = val - mean
        n = count + 1.0
        new_mean = tl.fma(delta, tl.math.div_rn(tl.full(n.shape, 1.0, tl.float32), n), mean)
        new_m2 = tl.fma(delta, val - new_mean, m2)
        return tl.where(ok, new_mean, mean), tl.where(ok, new_m2, m2), tl.where(ok, n, count)

    @triton.jit
    def _vec4(mean, m2, count, x, ok):
        """A lane's next float4 read (`x` [LANES, 4]), its values in order."""
        a, b = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))       # a: values 0, 2; b: 1, 3
        x0, x2 = tl.split(a)
        x1, x3 = tl.split(b)
        mean, m2, count = _online(mean, m2, count, x0, ok)
        mean, m2, count = _online(mean, m2, count, x1, ok)
        mean, m2, count = _online(mean, m2, count, x2, ok)
        return _online(mean, m2, count, x3, ok)

    @triton.jit
    def _combine(mb, sb, cb, ma, sa, ca):
        """torch's cuWelfordCombine(dataB=(mb, sb, cb), dataA=(ma, sa, ca)): a lane takes in the one above it."""
        delta = mb - ma
        count = ca + cb
        coef = tl.math.div_rn(tl.full(count.shape, 1.0, tl.float32), count)
        na = ca * coef
        nb = cb * coef
        mean = tl.fma(na, ma, _mul(nb, mb))
        m2 = tl.fma(delta * delta * ca, nb, sa + sb)
        some = count > 0.0
        return tl.where(some, mean, 0.0), tl.where(some, m2, 0.0), count

    @triton.jit
    def _row(N: tl.constexpr, S: tl.constexpr):
        """Offsets [S / 4, LANES, 4] of a row of N as torch's threads read it (lane l's g-th float4 holds values
        4 (g LANES + l) ...), and which exist."""
        g = tl.arange(0, S // 4)[:, None, None]
        lane = tl.arange(0, _LANES)[None, :, None]
        j = tl.arange(0, 4)[None, None, :]
        cols = (g * _LANES + lane) * 4 + j
        return cols, cols < N

    @triton.jit
    def _lane_pair(ma, sa, ca, mb, sb, cb):
        """tl.reduce's combine over lane states, one lane a thread: `a` the running (lower) lane, `b` its partner,
        in torch's orientation (cuWelfordCombine(dataB=a, dataA=b))."""
        return _combine(ma, sa, ca, mb, sb, cb)

    @triton.jit
    def _stats_lanes(x, N: tl.constexpr):
        """torch's mean and biased variance of a row held as [S / 4, LANES, 4] (`_row`): each lane folds its own
        float4 reads in order (no value leaves its thread before the tree), then one tl.reduce over the [LANES]
        states, which Triton runs as shuffles in each warp and a tree over the warps: torch's tree for lane 0."""
        lane = tl.arange(0, _LANES)
        zero = tl.zeros((_LANES,), tl.float32)
        if x.shape[0] == 2:
            x0, x1 = tl.split(tl.permute(x, (1, 2, 0)))
            m, s, c = _vec4(zero, zero, zero, x0, lane * 4 < N)
            m, s, c = _vec4(m, s, c, x1, (_LANES + lane) * 4 < N)
        else:
            m, s, c = _vec4(zero, zero, zero, tl.reshape(x, (_LANES, 4)), lane * 4 < N)
        m, s, c = tl.reduce((m, s, c), 0, _lane_pair)
        return m, tl.math.div_rn(s, tl.full(s.shape, N, tl.float32))

    @triton.jit
    def _affine(w_ptr, b_ptr, cols, ok, HAS_BIAS: tl.constexpr):
        """A norm's weight and bias (b = w without one)."""
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            return w, tl.load(b_ptr + cols, mask=ok, other=0.0)
        return w, w

    @triton.jit
    def _standard(x, eps, N: tl.constexpr):
        """(x - mean) / sqrt(var + eps) of the fp32 row `x` (`_row`) as torch's F.layer_norm computes it."""
        mean, var = _stats_lanes(x, N)
        return _rsqrt(var + eps) * (x - mean)

    @triton.jit
    def _scale(xn, w, b, HAS_BIAS: tl.constexpr):
        if HAS_BIAS:
            return tl.fma(w, xn, b)
        else:
            return _mul(w, xn)

    @triton.jit
    def _norm(x, ok, w_ptr, b_ptr, cols, eps, N: tl.constexpr, HAS_BIAS: tl.constexpr):
        """torch's F.layer_norm of the fp32 row `x` (`_row`), bit for bit."""
        xn = _standard(x, eps, N)
        w, b = _affine(w_ptr, b_ptr, cols, ok, HAS_BIAS)
        return _scale(xn, w, b, HAS_BIAS)

    @triton.jit
    def _finish_pending(h, t, cols, ok, p_ptr, pb_ptr, CHUNKS, sps, N: tl.constexpr, CD: tl.constexpr,
                        P_BIAS: tl.constexpr, P_APART: tl.constexpr):
        """h + epilogue(c0 + c1 + ...): kernels/gemm.py's RESIDUAL epilogue on the chunk sums of a split GEMM."""
        acc = tl.load(p_ptr + t * N + cols, mask=ok, other=0.0)
        for c in range(1, CHUNKS):
            acc = acc + tl.load(p_ptr + c * sps + t * N + cols, mask=ok, other=0.0)
        if P_BIAS:
            b = tl.load(pb_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            if P_APART:
                acc = acc.to(CD).to(tl.float32) + b
            else:
                acc = acc + b
        return h + acc.to(CD).to(tl.float32)

    @triton.jit
    def _embed_kernel(ids_ptr, start_ptr, len_ptr, emb_ptr, w_ptr, h_ptr, x_ptr, pos_ptr, row_ptr,
                      R, n_ids, pad_id, eps, N: tl.constexpr, S: tl.constexpr, RB: tl.constexpr,
                      USE_GDC: tl.constexpr):
        wait_turn(USE_GDC)   # kernels/launch.py: every earlier kernel done before touching memory
        t = tl.program_id(0)
        r = tl.arange(0, RB)
        r_ok = r < R
        s = tl.load(start_ptr + r, mask=r_ok, other=0)
        n = tl.load(len_ptr + r, mask=r_ok, other=0)
        mine = r_ok & (t >= s) & (t < s + n)
        row = tl.max(tl.where(mine, r, -1), 0)
        pos = tl.sum(tl.where(mine, t - s, 0), 0)
        tok = tl.load(ids_ptr + tl.minimum(t, n_ids - 1))
        tok = tl.where(row >= 0, tok, pad_id)
        cols, ok = _row(N, S)
        e = tl.load(emb_ptr + tok.to(tl.int64) * N + cols, mask=ok, other=0.0)
        y = _norm(e, ok, w_ptr, w_ptr, cols, eps, N, False)
        tl.store(h_ptr + t * N + cols, y, mask=ok)
        tl.store(x_ptr + t * N + cols, y.to(x_ptr.dtype.element_ty), mask=ok)
        tl.store(pos_ptr + t, pos)
        tl.store(row_ptr + t, row)

    @triton.jit
    def _layer_norm_kernel(h_ptr, w_ptr, b_ptr, x_ptr, eps, p_ptr, pb_ptr, CHUNKS, sps, N: tl.constexpr,
                           S: tl.constexpr, HAS_BIAS: tl.constexpr, USE_GDC: tl.constexpr,
                           PENDING: tl.constexpr = False, P_BIAS: tl.constexpr = False, P_APART: tl.constexpr = False):
        cols, ok = _row(N, S)
        if USE_GDC == 1:
            # Launched early (one wave, kernels/launch.py): the weights, which no kernel writes, load during the
            # wait instead of after the row's statistics. Device run of 2026-12-04 (seventeenth session, call 4): 101
            # -> 72 us of LayerNorm a 1x48 replay; in a multi-wave grid the same order cost 14% more (call 2).
            w, b = _affine(w_ptr, b_ptr, cols, ok, HAS_BIAS)
        wait_turn(USE_GDC)   # kernels/launch.py: every earlier kernel done before touching memory
        t = tl.program_id(0).to(tl.int64)
        h = tl.load(h_ptr + t * N + cols, mask=ok, other=0.0)
        if PENDING:
            h = _finish_pending(h, t, cols, ok, p_ptr, pb_ptr, CHUNKS, sps, N, x_ptr.dtype.element_ty, P_BIAS, P_APART)
            tl.store(h_ptr + t * N + cols, h, mask=ok)
        xn = _standard(h, eps, N)
        if USE_GDC != 1:
            w, b = _affine(w_ptr, b_ptr, cols, ok, HAS_BIAS)
        y = _scale(xn, w, b, HAS_BIAS)
        tl.store(x_ptr + t * N + cols, y.to(x_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _head_entry_kernel(h_ptr, row_ptr, qtype_ptr, fw_ptr, temb_ptr, w1_ptr, b1_ptr, x_ptr, eps, eps1,
                           p_ptr, pb_ptr, CHUNKS, sps, N: tl.constexpr, S: tl.constexpr, USE_GDC: tl.constexpr,
                           PENDING: tl.constexpr = False, P_BIAS: tl.constexpr = False, P_APART: tl.constexpr = False):
        wait_turn(USE_GDC)   # kernels/launch.py: every earlier kernel done before touching memory
        t = tl.program_id(0).to(tl.int64)
        cols, ok = _row(N, S)
        h = tl.load(h_ptr + t * N + cols, mask=ok, other=0.0)
        if PENDING:
            h = _finish_pending(h, t, cols, ok, p_ptr, pb_ptr, CHUNKS, sps, N, x_ptr.dtype.element_ty, P_BIAS, P_APART)
        row = tl.load(row_ptr + t)
        qt = tl.load(qtype_ptr + tl.maximum(row, 0))
        qt = tl.where(row >= 0, qt, 0)
        h = _norm(h, ok, fw_ptr, fw_ptr, cols, eps, N, False) + tl.load(temb_ptr + qt * N + cols, mask=ok, other=0.0)
        tl.store(h_ptr + t * N + cols, h, mask=ok)
        y = _norm(h, ok, w1_ptr, b1_ptr, cols, eps1, N, True)
        tl.store(x_ptr + t * N + cols, y.to(x_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _gather_norm_kernel(h_ptr, start_ptr, mk_ptr, w_ptr, b_ptr, x_ptr, K, L, T, eps,
                            N: tl.constexpr, S: tl.constexpr, USE_GDC: tl.constexpr):
        wait_turn(USE_GDC)   # kernels/launch.py: every earlier kernel done before touching memory
        i = tl.program_id(0)
        r = i // K
        at = tl.minimum(tl.maximum(tl.load(mk_ptr + i), 0), L - 1)
        # An absent marker, or a padding row's, reads some token's state (never used): clamp it into range.
        t = tl.minimum(tl.load(start_ptr + r) + at, T - 1).to(tl.int64)
        cols, ok = _row(N, S)
        h = tl.load(h_ptr + t * N + cols, mask=ok, other=0.0)
        y = _norm(h, ok, w_ptr, b_ptr, cols, eps, N, True)
        tl.store(x_ptr + i.to(tl.int64) * N + cols, y.to(x_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _features_kernel(score_ptr, mk_ptr, h_ptr, start_ptr, logits_ptr, act_in_ptr, K, T, absent, s_act,
                         N: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr, USE_GDC: tl.constexpr):
        wait_turn(USE_GDC)   # kernels/launch.py: every earlier kernel done before touching memory
        r = tl.program_id(0)
        j = tl.arange(0, WIDE)
        in_k = j < K
        present = (tl.load(mk_ptr + r * K + j, mask=in_k, other=-1) >= 0) & in_k
        score = tl.load(score_ptr + r * K + j, mask=in_k, other=0.0).to(tl.float32)
        logit = tl.where(present, score, absent)
        tl.store(logits_ptr + r * K + j, logit, mask=in_k)
        # One fixed width (WIDE) whatever K the bucket has: padding slots hold exp(absent - max) == 0, so the
        # sums below reduce the same values in the same order for every bucket.
        e = tl.exp(logit - tl.max(logit, 0))
        p = e / tl.sum(e, 0)
        kf = tl.maximum(tl.sum(present.to(tl.float32), 0), 2.0)
        ent = -tl.sum(p * tl.log(tl.maximum(p, 1e-9)), 0) / tl.log(kf)
        top1 = tl.max(p, 0)
        first = tl.min(tl.where(p == top1, j, WIDE), 0)
        top2 = tl.max(tl.where(j == first, -1.0, p), 0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        first_token = tl.minimum(tl.load(start_ptr + r), T - 1).to(tl.int64)      # padding rows: clamped
        cls = tl.load(h_ptr + first_token * N + cols, mask=ok, other=0.0)
        row = act_in_ptr + r * s_act
        tl.store(row + cols, cls.to(act_in_ptr.dtype.element_ty), mask=ok)
        tl.store(row + N, top1.to(act_in_ptr.dtype.element_ty))
        tl.store(row + N + 1, (top1 - top2).to(act_in_ptr.dtype.element_ty))
        tl.store(row + N + 2, ent.to(act_in_ptr.dtype.element_ty))
        tl.store(row + N + 3, (kf / 255.0).to(act_in_ptr.dtype.element_ty))

    @triton.jit
    def _softmax_kernel(x_ptr, y_ptr, C, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
        wait_turn(USE_GDC)   # kernels/launch.py: every earlier kernel done before touching memory
        r = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        ok = c < C
        x = tl.load(x_ptr + r * C + c, mask=ok, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, 0))
        tl.store(y_ptr + r * C + c, e / tl.sum(e, 0), mask=ok)


def _block(n: int) -> int:
    return triton.next_power_of_2(n)


def _warps(block: int) -> int:
    return 4 if block >= 1024 else (2 if block >= 256 else 1)


def width(n: int) -> int:
    """Reads per lane of a LayerNorm row of n values (`_row`); ValueError where torch's order is not ours."""
    if n % 4 or n > MAX_WIDTH:
        # torch takes another kernel where n % 4, and a lane would read more than twice past MAX_WIDTH
        raise ValueError(f"LayerNorm width {n}: the fast path holds multiples of 4 up to {MAX_WIDTH}")
    return 8 if n > 4 * LANES else 4


def embed(ids, row_start, row_len, emb, w, h, x, pos, row, pad_id: int, eps: float) -> None:
    t, n = h.shape
    rows = row_start.shape[0]
    dispatch(_embed_kernel, (t,), (ids, row_start, row_len, emb, w, h, x, pos, row, rows, ids.shape[0], pad_id, eps),
             dict(N=n, S=width(n), RB=_block(max(rows, 2)), **launch(h.device, t), num_warps=4), h.device)


def _pending_args(pending, h) -> tuple[tuple, dict]:
    """Kernel arguments for a split GEMM's `Pending` (kernels/gemm.py), or for none."""
    if pending is None:
        return (h, h, 1, 0), {}
    p = pending
    assert p.parts.shape[1:] == h.shape and p.parts.stride(1) == h.shape[1]
    return ((p.parts, p.bias if p.bias is not None else p.parts, p.chunks, p.parts.stride(0)),
            {"PENDING": True, "P_BIAS": p.bias is not None, "P_APART": p.bias_apart})


def layer_norm(h, w, b, x, eps: float, pending=None) -> None:
    """x <- bf16 LN(h); first h += the split GEMM `pending` left, if any."""
    t, n = h.shape
    args, flags = _pending_args(pending, h)
    dispatch(_layer_norm_kernel, (t,), (h, w, b if b is not None else w, x, eps, *args),
             dict(N=n, S=width(n), HAS_BIAS=b is not None, **flags, **launch(h.device, t), num_warps=4), h.device)


def head_entry(h, row, qtype, final_w, type_emb, w1, b1, x, eps: float, eps1: float, pending=None) -> None:
    t, n = h.shape
    args, flags = _pending_args(pending, h)
    dispatch(_head_entry_kernel, (t,), (h, row, qtype, final_w, type_emb, w1, b1, x, eps, eps1, *args),
             dict(N=n, S=width(n), **flags, **launch(h.device, t), num_warps=4), h.device)


def gather_norm(h, row_start, markers, w, b, x, max_row_len: int, eps: float) -> None:
    rows, k = markers.shape
    n = h.shape[1]
    dispatch(_gather_norm_kernel, (rows * k,), (h, row_start, markers, w, b, x, k, max_row_len, h.shape[0], eps),
             dict(N=n, S=width(n), **launch(h.device, rows * k), num_warps=4), h.device)


def features(score, markers, h, row_start, logits, act_in, absent: float, wide: int) -> None:
    rows, k = markers.shape
    n = h.shape[1]
    blk = _block(n)
    dispatch(_features_kernel, (rows,),
             (score, markers, h, row_start, logits, act_in, k, h.shape[0], absent, act_in.stride(0)),
             dict(N=n, BLOCK=blk, WIDE=_block(wide), **launch(h.device, rows), num_warps=_warps(blk)), h.device)


def softmax_rows(x, y) -> None:
    rows, c = x.shape
    dispatch(_softmax_kernel, (rows,), (x, y, c), dict(BLOCK=_block(max(c, 2)), **launch(x.device, rows), num_warps=1),
             x.device)


# Every Triton function's cache key now, in definition order (launch.settle_keys says why).
settle_keys(globals())
