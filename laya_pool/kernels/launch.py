"""How the fast path's kernels are launched: one place for the launch-time switches.

Programmatic dependent launch (PDL, Hopper and later): each kernel is launched while its predecessor is
still finishing, and waits (`griddepcontrol.wait`) before it touches memory, so the launch latency and the
block scheduling of ~200 small kernels overlap the kernels before them. Every kernel of the fast path waits
before it reads or writes any activation, so no kernel sees anything before all earlier kernels have finished: the
result is the same bits with or without it. Only what no kernel writes (weights, the rows' bounds) is read before
the wait. `LAYA_PDL=0` turns it off (a fallback, and for measuring the difference).

While it waits, a GEMM asks L2 for its own slice of the weights (`prefetch`): weights never depend on an earlier
kernel, so at small M, where a forward is the weights streaming through one GEMM after another, each GEMM's read
from HBM overlaps the kernels before it instead of starting when they end. A hint to the cache, so the same bits.

Not done: letting the successor launch before a kernel's own wait, so a chain of waiting kernels and their
prefetches runs ahead: 1x48 1.151 ms against 0.966 (the waiting blocks and their prefetches crowd the kernel that
computes), no gain at larger shapes (docs/decisions/0008-pdl-and-l2-prefetch.md).

Launching without Triton's dispatch (`dispatch`): Triton's `kernel[grid](...)` binds every argument, builds a cache
key as a string and checks the kernel's globals on every call, about 42 us of host time a launch on the H200's host
against 14 us for the compiled kernel called directly (docs/decisions/0009-launches-without-tritons-dispatch.md).
Eager mode is 217 launches a
forward, so that host time is eager mode's time. `dispatch` keeps each compiled kernel under a key made of what
Triton specializes on (each tensor's dtype and 16-byte alignment, each integer's value class, the constexprs and the
launch options) and calls it directly after the first launch of its kind; a graph capture records the same launch
either way. `LAYA_LAUNCH_CACHE=0` turns it off (every launch through Triton's dispatch).
"""
from __future__ import annotations

import os

import torch

from laya_pool.protocol import settings

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs have no Triton; only the CUDA path needs it
    triton = None


def toolkit_libdevice() -> str | None:
    """The CUDA toolkit's libdevice (CUDA_HOME, CUDA_PATH, /usr/local/cuda), or None."""
    for root in (settings.get("CUDA_HOME"), settings.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "nvvm/libdevice/libdevice.10.bc")):
            return os.path.join(root, "nvvm/libdevice/libdevice.10.bc")
    return None


def link_libdevice() -> str:
    """Point Triton at the toolkit's libdevice, whose erff gives torch's GELU bits (kernels/exact.py), unless told
    otherwise (TRITON_LIBDEVICE_PATH, or a path set already); returns the libdevice our kernels link.

    Called when this module is imported, before any kernel of ours can compile: Triton's in-memory kernel cache is
    keyed by the launch's own options, not by this knob, so a kernel compiled against Triton's own libdevice is
    reused after the knob changes. Linked any later, a process whose first GEMMs ran before any model was loaded
    kept GEGLU kernels with Triton's erff, and two 1x64 requests alone differed from the same
    requests merged (GELU outputs in [-5.4, -3.1]). The knob is the process's: any other Triton user in a process that
    imports our kernels links the toolkit's libdevice too (torch's inductor sets the same knob the same way)."""
    knobs = getattr(triton, "knobs", None)      # (Triton before 3.4 has none: its own libdevice, and the table)
    if knobs is None:
        return "none" if triton is None else "triton's own"
    if not settings.get("TRITON_LIBDEVICE_PATH") and not knobs.nvidia.libdevice_path:
        path = toolkit_libdevice()
        if path:
            knobs.nvidia.libdevice_path = path
    return knobs.nvidia.libdevice_path or "triton's own"


link_libdevice()


# Every setting that changes how a GEMM of ours is launched beyond its arguments: part of each GEMM plan's key
# (`switches`; `dispatch`'s key needs none: what they change reaches it as constexprs and launch options).
SWITCHES = ("LAYA_PDL", "LAYA_TMA", "LAYA_K_CHUNKS")
switches = settings.snapshot(SWITCHES)      # () -> their values as set now, unparsed (read on every cached launch)


def settle_keys(namespace: dict) -> None:
    """Compute the cache key of every Triton function in `namespace` (a kernel module's globals), in definition order.

    Called at the end of each kernel module, so a key does not depend on which kernel a process touched first:
    Triton 3.6 folds a helper's global constants into its caller's key only if the helper's own key was computed
    before (DependenciesFinder._update_hash merges the helper's `used_global_vals` before it asks for its key). The
    worker, which checks its GELU (exact.gelu) at load, and the compile-ahead children, which start from a GEMM, would
    get different keys for 31 of 35 kernels and compile them all twice (docs/decisions/0016-compile-ahead.md)."""
    if triton is None:
        return
    from triton.runtime.jit import JITFunction
    for value in list(namespace.values()):
        if isinstance(value, JITFunction):     # Triton's interpreter (TRITON_INTERPRET=1) has no keys: skipped
            _ = value.cache_key


def gdc(device: torch.device) -> bool:
    """Whether kernels on `device` wait for their predecessors in-kernel (so may be launched with PDL)."""
    if device.type != "cuda" or not settings.get("LAYA_PDL"):
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
    (the gap between two multi-wave kernels). Graph replay on an H200: 32x48 3.530 ms against 3.608, 4x256 2.501
    against 2.602, 1x48 and 16x512 unchanged, the same bits (docs/decisions/0008-pdl-and-l2-prefetch.md)."""
    wait = gdc(device)
    if wait and programs > sms(device):
        return {"USE_GDC": LATE, "launch_pdl": True}
    return {"USE_GDC": wait, "launch_pdl": wait and programs <= sms(device)}


def prefetching(options: dict) -> bool:
    """Whether a GEMM launched with `options` (from `launch`) should prefetch its weights while it waits: only
    when it is launched early (single-wave), so that there is a predecessor to overlap."""
    return options["launch_pdl"] and options["USE_GDC"] is True


_SMS: dict[int, int] = {}


def sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132                 # Triton's CPU interpreter (tests): any count will do
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


class Compiled:
    """A kernel Triton compiled, launched without its dispatch: its launcher and function, and the values of the
    parameters after the positional arguments of the launch it came from (constexprs and defaults: fixed by the key
    it is kept under)."""
    __slots__ = ("run", "function", "head", "tail")

    def __init__(self, kernel, compiled, positional: int, kwargs: dict):
        run = compiled.run               # (loads the module on first use: it was launched once already)
        self.function = compiled.function
        self.tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in kernel.params[positional:])
        # Triton 3.6's launcher object only adds scratch buffers (which our kernels never ask for) around its C
        # launch function: call that directly when there are none (2-3 us a launch less), else the object.
        if getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0:
            self.run = run.launch
            self.head = (run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata, None,
                         None, None)
        else:
            self.run = run
            self.head = (compiled.packed_metadata, None, None, None)

    def __call__(self, grid: tuple, args: tuple) -> None:
        """Launch on the current stream of the current device, as Triton's dispatch would (no launch hooks: `cached`
        is False while any is set)."""
        g = (*grid, 1, 1)
        self.run(g[0], g[1], g[2], _stream(_device()), self.function, *self.head, *args, *self.tail)


_ENTRIES: dict[tuple, Compiled] = {}
_MAX_ENTRIES = 4096       # a bound on a process's cache (keys hold value classes, not values: a few per kernel kind)
_device = _stream = None


def cached(device: torch.device) -> bool:
    """Whether launches on `device` go through `dispatch`'s cache (CUDA, Triton compiled rather than interpreted, no
    launch hooks such as a Triton profiler's, LAYA_LAUNCH_CACHE not 0, no compile-ahead recording open)."""
    if triton is None or device.type != "cuda" or not settings.get("LAYA_LAUNCH_CACHE") or _INTERPRETED or RECORDING:
        return False
    hooks = triton.knobs.runtime
    if _hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook):
        return False
    if _stream is None:
        _bind()
    return True


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: Triton 3.6 keeps a chain of them, and takes a plain function too."""
    return bool(hook.calls) if hasattr(hook, "calls") else hook is not None


def _bind() -> None:
    """Where a cached launch goes, as Triton's dispatch decides it: torch's current device (after CUDA's start, which
    a first launch has made, its C call alone) and that device's current raw stream."""
    global _device, _stream
    from triton.runtime.driver import driver
    _device = getattr(torch._C, "_cuda_getDevice", driver.active.get_current_device)
    _stream = driver.active.get_current_stream


def current_device() -> int:
    """The current CUDA device's index, as a cached launch's key holds it (call after `cached` said True)."""
    return _device()


_INTERPRETED = settings.get("TRITON_INTERPRET")     # read once, as Triton reads it for its jit decorator


def _spec(args: tuple) -> tuple | None:
    """What Triton specializes a launch's positional arguments on, or finer: a tensor's dtype and 16-byte alignment,
    an integer's class (equal to 1, divisible by 16, its width), a float's or a bool's type. None for anything else
    (a tensor descriptor): such a launch takes Triton's own dispatch."""
    out = []
    for a in args:
        kind = type(a)
        if kind is int:
            out.append((a == 1, a % 16 == 0, -2**31 <= a < 2**31, -2**63 <= a < 2**63))
        elif kind is float or kind is bool or a is None:
            out.append(kind)
        elif isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() % 16 == 0))
        else:
            return None
    return tuple(out)


RECORDING: list = []     # the hooks of kernels/compile.py's `recorded` blocks open now


def through_triton(kernel, grid: tuple, args: tuple, kwargs: dict):
    """kernel[grid](*args, **kwargs) through Triton's dispatch; while a compile-ahead recording is open (kernels/
    compile.py `recorded`), Triton's warm-up instead: a kernel not compiled yet is recorded by the recording's hook,
    and one compiled already is not launched either. (Launched, it would read what kernels skipped before it never
    wrote: a RoPE table indexed by the positions of an embedding that did not run faults the process;
    docs/decisions/0003-our-gemms-cublas-where-proven.md.)"""
    if RECORDING:
        kernel.warmup(*args, grid=grid, **kwargs)
        return None
    return kernel[grid](*args, **kwargs)


def compile_launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> Compiled | None:
    """kernel[grid](*args, **kwargs) through Triton's dispatch (compiling it if need be), and the compiled kernel to
    launch the same kind again directly (None where Triton returned none)."""
    compiled = through_triton(kernel, grid, args, kwargs)
    if compiled is None or not hasattr(compiled, "packed_metadata"):
        return None
    if _stream is None:
        _bind()
    return Compiled(kernel, compiled, len(args), kwargs)


def dispatch(kernel, grid: tuple, args: tuple, kwargs: dict, device: torch.device) -> None:
    """kernel[grid](*args, **kwargs) (every argument Triton specializes on positional, constexprs and launch options in
    kwargs), without Triton's dispatch once a launch of its kind was made (module docstring)."""
    if not cached(device):
        through_triton(kernel, grid, args, kwargs)
        return
    spec = _spec(args)
    if spec is None:
        through_triton(kernel, grid, args, kwargs)
        return
    # constexprs by value and type (Triton tells True from 1); what Triton also reads on each of its launches and
    # this key does not (TRITON_DEBUG, instrumentation, pre-run hooks, a kernel's globals changed since it compiled)
    # is fixed for a process of ours, or LAYA_LAUNCH_CACHE=0.
    key = (kernel, _device(), spec, tuple(kwargs.items()), tuple(map(type, kwargs.values())))
    entry = _ENTRIES.get(key)
    if entry is not None:
        entry(grid, args)
        return
    compiled = compile_launch(kernel, grid, args, kwargs)
    if compiled is not None:        # None: Triton launched nothing (a recording run, kernels/compile.py): ask again
        keep(_ENTRIES, key, compiled, _MAX_ENTRIES)


def keep(cache: dict, key, value, limit: int) -> None:
    """cache[key] = value, the cache emptied first when it holds `limit` entries: a bound on a process's launches,
    which eager mode (a new M every request) would otherwise grow without end; they are made again on first use."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value


def forget() -> None:
    """Drop every cached launch: whoever changes what a wrapper decides from without changing its arguments (a
    probe patching a kernel module's functions or constants between launches; `exact.prepare` deciding the GELU)
    calls this."""
    _ENTRIES.clear()
    for hook in _FORGET:
        hook()


_FORGET: list = []


def on_forget(hook) -> None:
    """Register another cache of launches (kernels/gemm.py's plans) for `forget` to clear."""
    _FORGET.append(hook)


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
