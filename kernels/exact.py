"""Rounding where torch rounds: the small pieces that make the fast path's row ops give the SDK's bits.

A 28-layer model carries a one-ulp difference anywhere to the whole fp32-vs-bf16 distance by its last layer
(docs/PERF.md, "parity"), so every op between GEMMs reproduces the torch op the SDK runs, bit for bit:

- `mul`: a product rounded on its own. Triton (like nvcc) fuses a multiply into the add that follows it; where
  torch runs the two as separate kernels (RoPE's `x * cos + rotate_half(x) * sin`, a LayerNorm's output before
  the next add), the product must be rounded first.
- `rsqrt`: what c10's `compat::rsqrt` (rsqrtf) compiles to.
- `gelu`: torch's erf-GELU. libdevice's erff (Triton's) and the CUDA math library's (torch's) differ in the last
  bit for some large negative arguments; on bf16 inputs that changes 11 of 65,280 GELU outputs, all in [-5.4, -3.1]
  (device probe, scripts/probe_rowexact.py). With LAYA_GELU_TABLE=1, for bf16 inputs in [-16, -1) the value comes
  from a table of torch's own F.gelu outputs, made on the device at load (`gelu_table`): 512 entries, exact.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice
except ImportError:  # CPU-only installs have no Triton; only the CUDA path needs it
    triton = None

TABLE_FIRST = 0xBF80      # bf16 bits of -1.0; the table runs to -16 (exclusive), 512 values in magnitude order
TABLE_SIZE = 512

if triton is not None:
    # Triton's CPU interpreter (tests) has no libdevice: there the plain operations stand in, which numpy never
    # fuses anyway.
    _LIBDEVICE = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
    _FIRST = tl.constexpr(TABLE_FIRST)
    _SIZE = tl.constexpr(TABLE_SIZE)
    # The table costs 15% of the GEMMs' time at 16x512 (12.7 -> 14.6 ms, device run 6, 2026-12-04) for 11 of 65,280
    # inputs: opt-in (LAYA_GELU_TABLE=1) until the fast path's other differences from torch are gone.
    _TABLE = tl.constexpr(os.environ.get("LAYA_GELU_TABLE") == "1")

    @triton.jit
    def mul(a, b):
        """a * b rounded on its own, never fused into a following add."""
        if _LIBDEVICE:
            return libdevice.mul_rn(a, b)
        else:
            return a * b

    @triton.jit
    def rsqrt(x):
        if _LIBDEVICE:
            return libdevice.rsqrt(x)
        else:
            return 1.0 / tl.sqrt(x)

    @triton.jit
    def gelu(x, table_ptr):
        """torch's F.gelu of a bf16 value held in fp32 (x * 0.5 * (1 + erf(x / sqrt 2))), as fp32."""
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
        if not _TABLE:
            return y
        i = x.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32) - _FIRST
        tail = (i >= 0) & (i < _SIZE)
        return tl.where(tail, tl.load(table_ptr + i, mask=tail, other=0.0).to(tl.float32), y)


_TABLES: dict[torch.device, torch.Tensor] = {}


def gelu_table(device: torch.device) -> torch.Tensor:
    """torch's F.gelu of the bf16 values from -1 down to -16 (bits TABLE_FIRST on), computed once on `device`.
    Made at model load (kernels/fast.py): never inside a CUDA graph capture, which would record it, not run it."""
    device = torch.device(device)
    if device not in _TABLES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gelu_table is made at load, not during a capture")
        bits = torch.arange(TABLE_FIRST, TABLE_FIRST + TABLE_SIZE, dtype=torch.int32).to(torch.int16)
        _TABLES[device] = torch.nn.functional.gelu(bits.view(torch.bfloat16).to(device)).contiguous()
    return _TABLES[device]
