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
"""
from __future__ import annotations

from .launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs have no Triton; only the CUDA path needs it
    triton = None


if triton is not None:
    @triton.jit
    def _norm(x, ok, w_ptr, b_ptr, cols, eps, N: tl.constexpr, HAS_BIAS: tl.constexpr):
        mean = tl.sum(x, 0) / N
        xc = tl.where(ok, x - mean, 0.0)
        var = tl.sum(xc * xc, 0) / N
        y = xc * (1.0 / tl.sqrt(var + eps)) * tl.load(w_ptr + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=ok, other=0.0)
        return y

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
                      R, n_ids, pad_id, eps, N: tl.constexpr, BLOCK: tl.constexpr, RB: tl.constexpr,
                      USE_GDC: tl.constexpr):
        if USE_GDC:   # kernels/launch.py: wait for every earlier kernel before touching memory
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
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
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        e = tl.load(emb_ptr + tok.to(tl.int64) * N + cols, mask=ok, other=0.0)
        y = _norm(e, ok, w_ptr, w_ptr, cols, eps, N, False)
        tl.store(h_ptr + t * N + cols, y, mask=ok)
        tl.store(x_ptr + t * N + cols, y.to(x_ptr.dtype.element_ty), mask=ok)
        tl.store(pos_ptr + t, pos)
        tl.store(row_ptr + t, row)

    @triton.jit
    def _layer_norm_kernel(h_ptr, w_ptr, b_ptr, x_ptr, eps, p_ptr, pb_ptr, CHUNKS, sps, N: tl.constexpr,
                           BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, USE_GDC: tl.constexpr,
                           PENDING: tl.constexpr = False, P_BIAS: tl.constexpr = False, P_APART: tl.constexpr = False):
        if USE_GDC:   # kernels/launch.py: wait for every earlier kernel before touching memory
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        h = tl.load(h_ptr + t * N + cols, mask=ok, other=0.0)
        if PENDING:
            h = _finish_pending(h, t, cols, ok, p_ptr, pb_ptr, CHUNKS, sps, N, x_ptr.dtype.element_ty, P_BIAS, P_APART)
            tl.store(h_ptr + t * N + cols, h, mask=ok)
        y = _norm(h, ok, w_ptr, b_ptr, cols, eps, N, HAS_BIAS)
        tl.store(x_ptr + t * N + cols, y.to(x_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _head_entry_kernel(h_ptr, row_ptr, qtype_ptr, fw_ptr, temb_ptr, w1_ptr, b1_ptr, x_ptr, eps, eps1,
                           p_ptr, pb_ptr, CHUNKS, sps, N: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr,
                           PENDING: tl.constexpr = False, P_BIAS: tl.constexpr = False, P_APART: tl.constexpr = False):
        if USE_GDC:   # kernels/launch.py: wait for every earlier kernel before touching memory
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
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
                            N: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
        if USE_GDC:   # kernels/launch.py: wait for every earlier kernel before touching memory
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        i = tl.program_id(0)
        r = i // K
        at = tl.minimum(tl.maximum(tl.load(mk_ptr + i), 0), L - 1)
        # An absent marker, or a padding row's, reads some token's state (never used): clamp it into range.
        t = tl.minimum(tl.load(start_ptr + r) + at, T - 1).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        h = tl.load(h_ptr + t * N + cols, mask=ok, other=0.0)
        y = _norm(h, ok, w_ptr, b_ptr, cols, eps, N, True)
        tl.store(x_ptr + i.to(tl.int64) * N + cols, y.to(x_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _features_kernel(score_ptr, mk_ptr, h_ptr, start_ptr, logits_ptr, act_in_ptr, K, T, absent, s_act,
                         N: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr, USE_GDC: tl.constexpr):
        if USE_GDC:   # kernels/launch.py: wait for every earlier kernel before touching memory
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
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
        if USE_GDC:   # kernels/launch.py: wait for every earlier kernel before touching memory
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
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


def embed(ids, row_start, row_len, emb, w, h, x, pos, row, pad_id: int, eps: float) -> None:
    t, n = h.shape
    rows = row_start.shape[0]
    b = _block(n)
    _embed_kernel[(t,)](ids, row_start, row_len, emb, w, h, x, pos, row, rows, ids.shape[0], pad_id, eps,
                        N=n, BLOCK=b, RB=_block(max(rows, 2)), **launch(h.device, t), num_warps=_warps(b))


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
    blk = _block(n)
    args, flags = _pending_args(pending, h)
    _layer_norm_kernel[(t,)](h, w, b if b is not None else w, x, eps, *args, N=n, BLOCK=blk, HAS_BIAS=b is not None,
                             **flags, **launch(h.device, t), num_warps=_warps(blk))


def head_entry(h, row, qtype, final_w, type_emb, w1, b1, x, eps: float, eps1: float, pending=None) -> None:
    t, n = h.shape
    blk = _block(n)
    args, flags = _pending_args(pending, h)
    _head_entry_kernel[(t,)](h, row, qtype, final_w, type_emb, w1, b1, x, eps, eps1, *args, N=n, BLOCK=blk,
                             **flags, **launch(h.device, t), num_warps=_warps(blk))


def gather_norm(h, row_start, markers, w, b, x, max_row_len: int, eps: float) -> None:
    rows, k = markers.shape
    n = h.shape[1]
    blk = _block(n)
    _gather_norm_kernel[(rows * k,)](h, row_start, markers, w, b, x, k, max_row_len, h.shape[0], eps, N=n, BLOCK=blk,
                                     **launch(h.device, rows * k), num_warps=_warps(blk))


def features(score, markers, h, row_start, logits, act_in, absent: float, wide: int) -> None:
    rows, k = markers.shape
    n = h.shape[1]
    blk = _block(n)
    _features_kernel[(rows,)](score, markers, h, row_start, logits, act_in, k, h.shape[0], absent, act_in.stride(0),
                              N=n, BLOCK=blk, WIDE=_block(wide), **launch(h.device, rows), num_warps=_warps(blk))


def softmax_rows(x, y) -> None:
    rows, c = x.shape
    _softmax_kernel[(rows,)](x, y, c, BLOCK=_block(max(c, 2)), **launch(x.device, rows), num_warps=1)
