"""Rounding where torch rounds: the small pieces that make the fast path's row ops give the SDK's bits.

A 28-layer model carries a one-ulp difference anywhere to the whole fp32-vs-bf16 distance by its last layer
(docs/PERF.md, "parity"), so every op between GEMMs reproduces the torch op the SDK runs, bit for bit:

- `mul`: a product rounded on its own. Triton (like nvcc) fuses a multiply into the add that follows it; where
  torch runs the two as separate kernels (RoPE's `x * cos + rotate_half(x) * sin`, a LayerNorm's output before
  the next add), the product must be rounded first.
- `rsqrt`: what c10's `compat::rsqrt` (rsqrtf) compiles to.
- `gelu`: torch's erf-GELU. The libdevice Triton ships and the CUDA toolkit's (whose erff torch's kernels were
  compiled with) differ in the last bit of erff for 12% of fp32 arguments in [-6, 6]; on bf16 inputs that changed 11
  of 65,280 GELU outputs, all in [-5.4, -3.1]. Triton linked against the toolkit's own libdevice gives torch's bits
  on all of them (device probe, 2026-12-04), so Triton is pointed there before any kernel
  of ours compiles (kernels/launch.py `link_libdevice`) and `prepare` checks every bf16 input against F.gelu on the
  device; only where some differ (another toolkit than torch's, or
  none) does the GELU take its [-16, -1) tail from a 512-entry table of torch's own outputs (`gelu_table`), which
  costs 15% of GEMM time. LAYA_GELU_TABLE=1 forces the table.
"""
from __future__ import annotations

import os

import torch

from .launch import env, forget, settle_keys

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
    def gelu(x, table_ptr, TABLE: tl.constexpr):
        """torch's F.gelu of a bf16 value held in fp32 (x * 0.5 * (1 + erf(x / sqrt 2))), as fp32; TABLE: the tail
        from `gelu_table` (module docstring)."""
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
        if not TABLE:
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


_DIFFER: dict[torch.device, int] = {}         # per device, by `prepare`: bf16 inputs whose GELU differs from torch's


def needs_table(device: torch.device) -> bool:
    """Whether GELUs on `device` take the table (decided by `prepare`; forced by LAYA_GELU_TABLE=1)."""
    return env("LAYA_GELU_TABLE") == "1" or _DIFFER.get(torch.device(device), 0) > 0


def prepare(device: torch.device) -> dict:
    """At model load: make the table and check every finite bf16 GELU input against F.gelu on the device (with the
    libdevice `link_libdevice` chose); the table is used only if some differ. Returns what it found (FastModel keeps
    it as `exactness`)."""
    device = torch.device(device)
    found: dict = {"libdevice": None, "gelu_differ": None}
    if device.type != "cuda" or triton is None:
        return found
    found["libdevice"] = triton.knobs.nvidia.libdevice_path or "triton's own"    # set at import (launch.py: why)
    gelu_table(device)
    if device not in _DIFFER:
        _DIFFER[device] = gelu_differs(device, table=False)
        forget()      # a GEMM plan made before this decision holds the other GELU (kernels/gemm.py `_plan_key`)
    found["gelu_differ"] = _DIFFER[device]
    found["gelu_table"] = needs_table(device)
    return found


def bf16_values(device: torch.device) -> torch.Tensor:
    """Every finite bf16 value (65,280 of them)."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    return x[torch.isfinite(x)].to(device)


def gelu_differs(device: torch.device, table: bool) -> int:
    """How many finite bf16 inputs our GELU maps to other bits than F.gelu does, on `device`."""
    x = bf16_values(device)
    y = torch.empty_like(x)
    _gelu_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, gelu_table(device), x.numel(), TABLE=table, BLOCK=1024)
    ref = torch.nn.functional.gelu(x)
    return int((y != ref).sum())        # by value: -0.0 and 0.0 are one answer


if triton is not None:
    @triton.jit
    def _gelu_kernel(x_ptr, y_ptr, table_ptr, n, TABLE: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        x = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + i, gelu(x, table_ptr, TABLE).to(y_ptr.dtype.element_ty), mask=ok)


# Every Triton function's cache key now, in definition order (launch.settle_keys says why).
settle_keys(globals())
