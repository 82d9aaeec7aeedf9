"""A batch-invariant linear layer for CUDA: one row's result never depends on the rows around it.

cuBLAS picks its kernel (tile shape, split-K) from the problem size, so the same row multiplied as
part of 48 rows or of 8192 rows can round differently, and a request padded into a CUDA graph's
bucket would not answer exactly what it answers eagerly. This kernel has one fixed tiling and
accumulates every output element over K in the same order whatever M is, which makes eager, fixed-
graph and cached-graph execution byte-identical. On the CPU the plain `F.linear` is used: a CPU
worker has one execution mode only.
"""
from __future__ import annotations

import torch

from .launch import settle_keys, through_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs have no Triton; only the CUDA path needs it
    triton = None


if triton is not None:
    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                       sxm, sxk, swn, swk, sym, syn,
                       HAS_BIAS: tl.constexpr, BIAS_APART: tl.constexpr, IEEE: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if BIAS_APART:    # round the product first, then add: torch's unfused `mm` + `add_`
                acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32) + bias
            else:
                acc += bias
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           invariant: bool = True, bias_apart: bool = False) -> torch.Tensor:
    """y = x @ w.T + b with fp32 accumulation, in x's dtype; batch-invariant on CUDA.

    `invariant=False` takes cuBLAS (`F.linear`) instead: the SDK's own kernels, which give its
    bits exactly when the rows are laid out as the SDK lays them out, but are not batch-invariant.
    `bias_apart=True` rounds x @ w.T to x's dtype before adding the bias, as torch does when
    `F.linear` gets a non-contiguous 3-D input (matmul, then a separate add) instead of one fused
    GEMM with a bias epilogue: the SDK's decision-head attention projections take that path.
    """
    if not invariant or x.device.type != "cuda" or triton is None:
        plain = torch.nn.functional.linear     # (not imported at the top: kernels/compile.py `defer_torch`)
        if bias_apart and b is not None:
            return plain(x, w) + b
        return plain(x, w, b)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    M, K = x2.shape
    N = w.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    ieee = x.dtype == torch.float32
    BM, BN, BK = (32, 64, 32) if ieee else (64, 128, 64)
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    args = (x2, w, b if b is not None else w, y, M, N, K,
            x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1))
    through_triton(_linear_kernel, grid, args, dict(HAS_BIAS=b is not None, BIAS_APART=bias_apart, IEEE=ieee,
                                                    BM=BM, BN=BN, BK=BK, num_warps=4, num_stages=3))
    return y.reshape(*shape[:-1], N)


# Every Triton function's cache key now, in definition order (launch.settle_keys says why).
settle_keys(globals())
