"""How the fast path's kernels are launched: one place for the launch-time switches.

Programmatic dependent launch (PDL, Hopper and later): each kernel is launched while its predecessor is
still finishing, and waits (`griddepcontrol.wait`) before it touches memory, so the launch latency and the
block scheduling of ~200 small kernels overlap the kernels before them. Every kernel of the fast path waits
before it reads or writes any activation, so no kernel sees anything before all earlier kernels have finished: the
result is the same bits with or without it. `LAYA_PDL=0` turns it off (for measuring the difference).

While it waits, a GEMM asks L2 for its own slice of the weights (`prefetch`): weights never depend on an earlier
kernel, so at small M, where a forward is the weights streaming through one GEMM after another, each GEMM's read
from HBM overlaps the kernels before it instead of starting when they end. A hint to the cache, so the same bits;
`LAYA_PREFETCH=0` turns it off.

Tried and dropped (device run of 2026-12-04, twelfth session): letting the successor launch before a kernel's own
wait, so a chain of waiting kernels and their prefetches runs ahead: 1x48 1.151 ms against 0.966 (the waiting
blocks and their prefetches crowd the kernel that computes), no gain at larger shapes.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs have no Triton; only the CUDA path needs it
    triton = None


def settle_keys(namespace: dict) -> None:
    """Compute the cache key of every Triton function in `namespace` (a kernel module's globals), in definition order.

    Called at the end of each kernel module, so a key no longer depends on which kernel a process touched first:
    Triton 3.6 folds a helper's global constants into its caller's key only if the helper's own key was computed
    before (DependenciesFinder._update_hash merges the helper's `used_global_vals` before it asks for its key). The
    worker, which checks its GELU (exact.gelu) at load, and the compile-ahead children, which start from a GEMM, got
    different keys for 31 of 35 kernels and compiled them all twice (docs/PERF.md, fifteenth session, call 1)."""
    if triton is None:
        return
    from triton.runtime.jit import JITFunction
    for value in list(namespace.values()):
        if isinstance(value, JITFunction):     # Triton's interpreter (TRITON_INTERPRET=1) has no keys: skipped
            _ = value.cache_key


def gdc(device: torch.device) -> bool:
    """Whether kernels on `device` wait for their predecessors in-kernel (so may be launched with PDL)."""
    if device.type != "cuda" or os.environ.get("LAYA_PDL", "1") == "0":
        return False
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _HOPPER:          # asked on every launch: read the device once
        _HOPPER[i] = torch.cuda.get_device_capability(i)[0] >= 9
    return _HOPPER[i]


_HOPPER: dict[int, bool] = {}


LATE = 2      # USE_GDC: launched early, but lets its successor launch only as its blocks exit (`wait_turn`)


def launch(device: torch.device, programs: int) -> dict:
    """Launch options for a kernel of `programs` blocks. Only a grid of at most one block per SM is launched
    early: a larger grid's waiting blocks would hold SMs its predecessor still needs (measured: PDL on every
    launch made a 32x48 forward 6% slower, on single-wave launches only it makes 1x48 7% faster).

    A larger grid is launched early too, but does not let ITS successor launch until its own blocks exit, so no
    successor block waits on an SM while it still has blocks to place; what is left to overlap is the launch itself
    (the gap between two multi-wave kernels). Device run of 2026-12-04 (fourteenth session, call 2), graph replay:
    32x48 3.530 ms against 3.608, 4x256 2.501 against 2.602, 1x48 and 16x512 unchanged, the same bits.
    LAYA_PDL_WAVES=one: only single-wave grids early (as before)."""
    wait = gdc(device)
    if wait and programs > sms(device) and os.environ.get("LAYA_PDL_WAVES", "all") == "all":
        return {"USE_GDC": LATE, "launch_pdl": True}
    return {"USE_GDC": wait, "launch_pdl": wait and programs <= sms(device)}


def prefetching(options: dict) -> bool:
    """Whether a GEMM launched with `options` (from `launch`) should prefetch its weights while it waits: only
    when it is launched early (single-wave), so that there is a predecessor to overlap."""
    return options["launch_pdl"] and options["USE_GDC"] is True and os.environ.get("LAYA_PREFETCH", "1") != "0"


_SMS: dict[int, int] = {}


def sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132                 # Triton's CPU interpreter (tests): any count will do
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


if triton is not None:
    @triton.jit
    def wait_turn(USE_GDC: tl.constexpr):
        """A kernel's first step under PDL: wait for every earlier kernel, then let the next one launch (LATE: the next
        one launches as this kernel's blocks exit, `launch`)."""
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
            if USE_GDC != 2:
                tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch(base, nbytes, PIECES: tl.constexpr):
        """Ask L2 to fetch the `nbytes` bytes at `base` (16-byte aligned, a multiple of 16), in PIECES bulk requests
        (sm_90's cp.async.bulk.prefetch.L2: no registers, no shared memory, nothing to wait for)."""
        piece = ((nbytes + PIECES - 1) // PIECES + 15) // 16 * 16
        off = tl.arange(0, PIECES) * piece
        size = tl.minimum(tl.maximum(nbytes - off, 0), piece)
        addr = base.to(tl.pointer_type(tl.int8)).to(tl.int64, bitcast=True) + off
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


# Every Triton function's cache key now, in definition order (launch.settle_keys says why).
settle_keys(globals())
