"""Model-step variants for scripts/probe_fast.py (PROBE_MODEL_VARIANTS=cubres,cubqkv,cublas): cuBLAS's product for
the encoder's residual and QKV GEMMs at M >= LOW, with what our fused epilogues did moved elsewhere.

Why: at M = 1,536 (a merged group of 32x48) our QKV and residual GEMMs take 1.7-1.8x cuBLAS's plain product
(seventeenth session, probe_timeline), and cuBLAS gave our GEMMs' bits at every M for K = 1,024 and from M = 256
for K = 2,624 (fourteenth session, probe_fast.py `cublas`). Whether the whole forward keeps its bits is what the
model step checks (`same bits` against the default forward, per shape).

- cubres: h += a @ w.T becomes y = bf16(a @ w.T) by cuBLAS, left as a one-chunk `Pending` for the LayerNorm after
  it (kernels/rows.py adds h + fp32(y), the RESIDUAL epilogue's rounding when there is no bias), so the GEMM
  writes 2 bytes an element instead of reading and writing h's 8.
- cubqkv: the QKV product by cuBLAS on the unpermuted weight, then RoPE in place by `_rope_kernel` (the ROPE
  epilogue's arithmetic: each product rounded alone, kernels/exact.py `mul`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from laya_pool.kernels.exact import mul
from laya_pool.kernels.gemm import Epi, Pending

LOW = 256       # cuBLAS split K for K = 2,624 below it (fourteenth session)


@triton.jit
def _rope_kernel(y_ptr, pos_ptr, cos_ptr, sin_ptr, stride, HEADS: tl.constexpr, HALF: tl.constexpr):
    """Token program_id(0)'s first HEADS heads of y [T, *] (query and key) rotated by its position, in place."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS)
    j = tl.arange(0, HALF)
    p = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + p * HALF + j)[None, :]
    s = tl.load(sin_ptr + p * HALF + j)[None, :]
    first = y_ptr + t * stride + head[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(first).to(tl.float32)
    x2 = tl.load(first + HALF).to(tl.float32)
    tl.store(first, (mul(x1, c) - mul(x2, s)).to(y_ptr.dtype.element_ty))
    tl.store(first + HALF, (mul(x2, c) + mul(x1, s)).to(y_ptr.dtype.element_ty))


def unpaired(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """kernels/gemm.py `rope_pairs` undone: the checkpoint's row order."""
    n, k = w.shape
    return w.view(n // head_dim, head_dim // 2, 2, k).transpose(1, 2).reshape(n, k).contiguous()


def residual_variant(orig):
    def residual(a, w, h, parts, *, bias=None, bias_apart=False, **kw):
        if bias is not None or a.shape[0] < LOW or kw:
            return orig(a, w, h, parts, bias=bias, bias_apart=bias_apart, **kw)
        y = torch.empty((1, a.shape[0], w.shape[0]), device=a.device, dtype=a.dtype)
        torch.mm(a, w.t(), out=y[0])
        return Pending(y, 1, None, False)
    return residual


def qkv_variant(orig):
    natural: dict[int, torch.Tensor] = {}    # by the paired weight's address; filled by the eager call before capture

    def gemm(a, w, out, *, epi=Epi.PLAIN, rope=None, **kw):
        if epi != Epi.ROPE or a.shape[0] < LOW or kw:
            return orig(a, w, out, epi=epi, rope=rope, **kw)
        pos, cos, sin, head_dim, heads = rope
        assert heads & (heads - 1) == 0 and out.is_contiguous()
        wn = natural.get(w.data_ptr())
        if wn is None:
            wn = natural[w.data_ptr()] = unpaired(w, head_dim)
        torch.mm(a, wn.t(), out=out)
        _rope_kernel[(a.shape[0],)](out, pos, cos, sin, out.stride(0), HEADS=heads, HALF=head_dim // 2,
                                    num_warps=2)
        return out
    return gemm


def patches() -> dict:
    """probe_fast.py's variant table entries: name -> (description, [(module, attribute, value), ...])."""
    from laya_pool.kernels import fast
    res = (fast, "residual", residual_variant(fast.residual))
    qkv = (fast, "gemm", qkv_variant(fast.gemm))
    return {"cubres": (f"cuBLAS residual GEMMs, h added by the next LayerNorm, M >= {LOW}", [res]),
            "cubqkv": (f"cuBLAS QKV product + RoPE kernel, M >= {LOW}", [qkv]),
            "cublas": (f"cuBLAS residual and QKV GEMMs, M >= {LOW}", [res, qkv])}
