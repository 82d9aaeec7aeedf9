"""cuBLAS's product for the encoder's QKV and residual GEMMs, where it is proven on this device to give our bits.

Why: at M = 1,536 (a merged group of 32x48) our fused QKV and residual GEMMs take 1.7-1.8x cuBLAS's plain product,
and the whole forward with cuBLAS there runs 17% faster with the same bits (32x48 3.051 against 3.666 ms on an H100;
docs/decisions/0003-our-gemms-cublas-where-proven.md). cuBLAS promises no K order, so its bits are never taken
on trust: before a shape first uses it, `Products.use` runs both ways on this device (our fused kernel, and cuBLAS's
product with the fused work done by the next kernel) and takes cuBLAS only where every output bit is equal. Our
kernels reduce each output in one K order whatever M is (kernels/gemm.py), so a shape proven equal to ours is
batch-invariant too, and a shape not (yet) proven runs our kernel: the bits never depend on which one ran.

A proof needs a host synchronisation, so none runs inside a graph capture or a compile-ahead recording
(kernels/compile.py): those shapes run our kernel until an eager forward of the same shape proves them, which the
worker's capture does first (worker/capture.py `Capturer.capture`). What cuBLAS's product leaves to others:
- QKV: the product lands in the checkpoint's row order and `rope` rotates query and key heads in place with the ROPE
  epilogue's arithmetic (kernels/gemm.py: the product rounded to bf16, each product with the tables rounded alone);
- residual: the bf16 product is left as a one-chunk `Pending` that the next LayerNorm adds to the fp32 stream
  (kernels/rows.py), the RESIDUAL epilogue's rounding when there is no bias.
On by default; LAYA_CUBLAS=0 turns it off. Two things keep it safe in a process that builds several runtimes: a
compile-ahead recording launches nothing, not even a kernel compiled already (kernels/launch.py `through_triton`; a
launched `rotate` would read RoPE tables at positions the skipped embedding never wrote, and fault the context), and a
runtime makes its stream's cuBLAS workspace at start (`workspace`), so memory accounting does not count it as a leak.
Graph replay, on against off (H100): 32x48 3.051 / 3.666 ms, 4x256 2.415 / 2.600, 16x512 14.958 / 15.510, the same
bits.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from laya_pool.protocol import settings

from .gemm import Pending
from .launch import dispatch, launch, settle_keys

try:
    import triton
    import triton.language as tl

    from .exact import mul as _mul
    from .launch import wait_turn
except ImportError:  # CPU-only installs have no Triton
    triton = None

LOW = 256         # below it cuBLAS splits K = 2,624 (not our bits) and gains nothing at K = 1,024
MAX_PROOFS = 4096  # eager mode meets a new M on every request: a bound, then prove again


def wanted(m: int) -> bool:
    """Whether a GEMM of M rows may try cuBLAS at all (not with LAYA_CUBLAS=0)."""
    return m >= LOW and settings.get("LAYA_CUBLAS")


def workspace(stream: torch.cuda.Stream) -> None:
    """cuBLAS's workspace for `stream` made now, if cuBLAS may be used: torch makes it at a stream's first product
    (32 MiB on Hopper) and keeps it, which a runtime's memory accounting would otherwise count as a leak of whatever
    ran first at M >= LOW (tests/test_runtime_gpu.py's capture-failure test)."""
    if not wanted(LOW):
        return
    with torch.cuda.stream(stream):
        a = torch.zeros(16, 16, device=stream.device, dtype=torch.bfloat16)
        torch.mm(a, a)


class Proofs:
    """What was proven, by shape: True (cuBLAS gives our bits there), False (it does not: our kernel), or unknown.
    Pure bookkeeping, bounded; `Products` does the proving."""

    def __init__(self, limit: int = MAX_PROOFS):
        self.limit = limit
        self.known: dict[Hashable, bool] = {}

    def get(self, key: Hashable) -> bool | None:
        return self.known.get(key)

    def put(self, key: Hashable, equal: bool) -> None:
        if len(self.known) >= self.limit:
            self.known.clear()
        self.known[key] = equal

    def summary(self) -> dict[str, int]:
        return {"proven": sum(self.known.values()), "refused": sum(not v for v in self.known.values())}


class Products:
    """One model's cuBLAS decisions: `use(key, prove)` is True where `prove()` showed equal bits for `key`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.proofs = Proofs()

    def use(self, key: Hashable, prove: Callable[[], bool]) -> bool:
        from .compile import recording
        known = self.proofs.get(key)
        if known is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return False                  # a proof synchronises: not inside a capture
            if recording():
                # A compile-ahead recording launches nothing, so the proof's answer means nothing; its launches are
                # recorded, which are every kernel either product needs at this shape: the warm-up compiles none.
                prove()
                return False
            known = prove()
            self.proofs.put(key, known)
        return known


def key(kind: str, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> tuple:
    """What a proof holds for: cuBLAS picks its kernel by shapes, strides, alignments and torch's reduction flag."""
    flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    return (kind, flag, *(d for t in (a, w, out) for d in (*t.shape, *t.stride(), t.data_ptr() % 256)))


def like(t: torch.Tensor, random: bool = False) -> torch.Tensor:
    """A new tensor laid out as `t` (shape, strides, the address's offset from 256 bytes), so that cuBLAS picks the
    kernel for it that it picks for `t`; standard normal values if `random` (a fixed seed: a proof draws nothing
    from torch's generator)."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    item = t.element_size()
    pad = 256 // item
    flat = torch.empty(span + pad, device=t.device, dtype=t.dtype)
    shift = ((t.data_ptr() - flat.data_ptr()) % 256) // item
    out = flat[shift:].as_strided(t.shape, t.stride())
    if random:
        g = torch.Generator(t.device).manual_seed(0)
        out.copy_(torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32))
    return out


def natural(w_pairs: torch.Tensor, head_dim: int) -> torch.Tensor:
    """kernels/gemm.py `rope_pairs` undone: the checkpoint's row order, which cuBLAS's product needs."""
    n, k = w_pairs.shape
    return w_pairs.view(n // head_dim, head_dim // 2, 2, k).transpose(1, 2).reshape(n, k).contiguous()


def qkv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, rope: tuple) -> None:
    """out <- the ROPE epilogue's result (kernels/gemm.py) from cuBLAS's product with `w` in the checkpoint's order."""
    pos, cos, sin, head_dim, heads = rope
    torch.mm(x, w.t(), out=out)
    rotate(out, pos, cos, sin, head_dim, heads)


def rotate(y: torch.Tensor, pos, cos, sin, head_dim: int, heads: int) -> None:
    """The first `heads` heads of y [T, *] (query and key) rotated in place by each token's position."""
    assert y.stride(1) == 1, "rope: unit column stride"
    t = y.shape[0]
    half = head_dim // 2
    # Block sizes are powers of two (12 heads of 64 in the multilingual preset: 24 rotated heads, a block of 32)
    dispatch(_rope_kernel, (t,), (y, pos, cos, sin, y.stride(0)),
             dict(HEADS=heads, HALF=half, HEADS_P2=triton.next_power_of_2(heads), HALF_P2=triton.next_power_of_2(half),
                  **launch(y.device, t), num_warps=2), y.device)


def residual(a: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Pending:
    """y[0] <- bf16(a @ w.T) by cuBLAS, left for the next LayerNorm to add to the residual stream."""
    torch.mm(a, w.t(), out=y[0])
    return Pending(y, 1, None, False)


if triton is not None:
    @triton.jit
    def _rope_kernel(y_ptr, pos_ptr, cos_ptr, sin_ptr, stride, HEADS: tl.constexpr, HALF: tl.constexpr,
                     HEADS_P2: tl.constexpr, HALF_P2: tl.constexpr, USE_GDC: tl.constexpr):
        wait_turn(USE_GDC)   # kernels/launch.py: every earlier kernel done before touching memory
        t = tl.program_id(0).to(tl.int64)
        head = tl.arange(0, HEADS_P2)
        j = tl.arange(0, HALF_P2)
        p = tl.load(pos_ptr + t)
        c = tl.load(cos_ptr + p * HALF + j, mask=j < HALF, other=0.0)[None, :]
        s = tl.load(sin_ptr + p * HALF + j, mask=j < HALF, other=0.0)[None, :]
        first = y_ptr + t * stride + head[:, None] * (2 * HALF) + j[None, :]
        inside = (head[:, None] < HEADS) & (j[None, :] < HALF)
        x1 = tl.load(first, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=inside, other=0.0).to(tl.float32)
        # torch's x * cos + rotate_half(x) * sin, as the ROPE epilogue computes it: each product rounded alone
        tl.store(first, (_mul(x1, c) - _mul(x2, s)).to(y_ptr.dtype.element_ty), mask=inside)
        tl.store(first + HALF, (_mul(x2, c) + _mul(x1, s)).to(y_ptr.dtype.element_ty), mask=inside)



# Every Triton function's cache key now, in definition order (launch.settle_keys says why).
settle_keys(globals())
