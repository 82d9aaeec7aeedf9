#!/usr/bin/env python3
"""Device debug: tests/test_runtime_gpu.py's first test as a plain script (same order, nothing before it).

On an upload failure it prints what the CUDA runtime knows about the pointers and the thread's context,
and retries the copy from other staging buffers, so the failing party can be named.
"""
import os
import sys

# The checkout root, for laya_pool where it is not installed.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from test_runtime_gpu import CAP, frozen_batches  # noqa: E402

from laya_pool.worker.checkpoint import load_checkpoint  # noqa: E402
from laya_pool.worker.runtime import Runtime, RuntimeConfig  # noqa: E402


def diagnose(rts):
    """Is the context itself broken (torch fails too), or only the call that failed?"""
    from laya_pool.worker.cudart import PinnedBuffer, memcpy_async, stream_synchronize
    try:
        torch.cuda.synchronize()
        print("torch synchronize ok; torch copy", torch.ones(4, device="cuda").sum().item(), flush=True)
    except Exception as e:
        print("torch fails too:", repr(e)[:200], flush=True)
    for m, r in rts.items():
        try:
            fresh = PinnedBuffer(4096)
            memcpy_async(r.workspace.device_address, fresh.ptr, 64, True, r.stream.cuda_stream)
            stream_synchronize(r.stream.cuda_stream)
            print(m, "fresh pinned upload ok", flush=True)
        except Exception as e:
            print(m, "fresh pinned upload fails:", repr(e)[:200], flush=True)


def watch_pos():
    """DEBUG_POS=1: after every eager embed, check the positions it wrote (and what it read) on the host."""
    import laya_pool.kernels.fast as fast
    import laya_pool.kernels.rows as rows
    real = rows.embed

    def embed(ids, row_start, row_len, emb, w, h, x, pos, row, pad_id, eps):
        real(ids, row_start, row_len, emb, w, h, x, pos, row, pad_id, eps)
        if torch.cuda.is_current_stream_capturing():
            return
        torch.cuda.synchronize()
        p = pos.cpu()
        if int(p.min()) < 0 or int(p.max()) >= 4096:
            print("EMBED WROTE BAD POS", int(p.min()), int(p.max()), "T", pos.shape[0], "starts",
                  row_start.cpu().tolist(), "lens", row_len.cpu().tolist(), flush=True)
    fast.rk.embed = embed


def narrow_rope():
    """DEBUG_NARROW_ROPE=1: RoPE tiles never wider than half a head (the tiling before 2026-12-03's session 5)."""
    import laya_pool.kernels.gemm as g
    real = g.pick_tiles

    def pick(m, n_out, k, epi, sms=132):
        t = real(m, n_out, k, epi, sms)
        return g.Tiles(t.bm, min(t.bn, 16), t.bk, t.warps, t.stages) if epi == g.Epi.ROPE else t
    g.pick_tiles = pick


LAUNCHES: list = []
GEMM: list = []
COUNTS: list = []


def watch_launches():
    """DEBUG_LAUNCHES=1: say every Triton compile and module load (and whether a capture was under way), and keep
    the last launches to print when a run fails: names the kernel whose launch fails inside a capture."""
    from collections import deque

    from triton import knobs
    last = deque(maxlen=12)
    LAUNCHES.append(last)

    def capturing() -> bool:
        # On a faulted context this query raises too: say so (with the launches before it) instead of
        # losing the hook's own report (the fifth and sixth sessions' hooks printed nothing for that reason)
        try:
            return torch.cuda.is_current_stream_capturing()
        except Exception as e:
            print("CONTEXT FAULTED (seen by a launch hook) after", list(last)[-4:], "gemm", GEMM[-1:],
                  repr(e)[:100], flush=True)
            if ALLOCS:
                print("forward's allocations (shape, dtype, start, end):", ALLOCS[-14:], flush=True)
            raise

    def compiled(*args, **kwargs):
        key = args[0] if args else kwargs.get("key")
        print(f"[triton] compiled {str(key)[:120]} capturing={capturing()}", flush=True)

    def loading(module, function, name, metadata_group, hash_):
        print(f"[triton] loading {name} capturing={capturing()}", flush=True)

    def enter(meta):
        data = getattr(meta, "data", {}) or {}
        last.append((data.get("name"), capturing()))
        if capturing() and COUNTS:
            COUNTS[0]["in_capture"] += 1

    def leave(meta):
        # DEBUG_EXEC=1 (with CUDA_LAUNCH_BLOCKING=1): a device-wide sync after every launch outside a capture names
        # the kernel whose *execution* faults, with the GEMM's launch parameters
        if os.environ.get("DEBUG_POSWATCH") == "1" and not capturing():
            check_positions(last)
        if os.environ.get("DEBUG_EXEC") != "1" or capturing():
            return
        try:
            torch.cuda.synchronize()
        except Exception as e:
            print("EXECUTION FAULT after", list(last)[-3:], "gemm", GEMM[-1:], repr(e)[:160], flush=True)
            raise

    knobs.runtime.jit_post_compile_hook = compiled
    knobs.runtime.kernel_load_start_hook = loading
    knobs.runtime.launch_enter_hook = enter
    knobs.runtime.launch_exit_hook = leave
    import laya_pool.kernels.gemm as g
    real = g._launch

    def launch(a, w, out, epi, bias, bias_apart, act, rope, tiles, tma, chunk, split_stride):
        t = tiles or g.pick_tiles(a.shape[0], w.shape[0], a.shape[1], epi, g.sms(a.device))
        ptrs = {"a": a.data_ptr(), "out": out.data_ptr(), "out_end": out.data_ptr() + out.untyped_storage().nbytes()}
        if rope is not None:
            ptrs["pos"] = rope[0].data_ptr()
        GEMM.append((str(epi), tuple(a.shape), tuple(w.shape), tuple(out.shape), out.stride(), t, tma, chunk,
                     split_stride, capturing(), ptrs))
        del GEMM[:-4]
        return real(a, w, out, epi, bias, bias_apart, act, rope, tiles, tma, chunk, split_stride)
    g._launch = launch

    from laya_pool.worker.runtime import Runtime
    forward = Runtime._forward

    def traced(self, shape, taps=None, slot=0):
        try:
            return forward(self, shape, taps, slot)
        except Exception:
            import traceback
            print(f"FORWARD RAISED shape {shape}; last gemms {GEMM}", flush=True)
            traceback.print_exc()
            raise
    Runtime._forward = traced
    watch_capture_phases()


ALLOCS: list = []
WATCH: dict = {}


def watch_positions():
    """DEBUG_POSWATCH=1: after every kernel outside a capture, compare the current forward's token positions with
    what its embed wrote; the first kernel that changes them is named with the forward's allocations (the
    sanitizer saw the RoPE epilogue read garbage positions: who writes over them?)."""
    import laya_pool.kernels.fast as fast
    real_embed = fast.rk.embed

    def embed(ids, row_start, row_len, emb, w, h, x, pos, row, pad_id, eps):
        real_embed(ids, row_start, row_len, emb, w, h, x, pos, row, pad_id, eps)
        WATCH.clear()
        if torch.cuda.is_current_stream_capturing():
            return
        torch.cuda.synchronize()
        WATCH.update(pos=pos, expect=pos.cpu().clone(), kernels=0)
    fast.rk.embed = embed

    class Recorder:
        """fast.py's `torch`: every `empty` of a forward recorded with its address range."""
        def __getattr__(self, name):
            return getattr(torch, name)

        def empty(self, *a, **k):
            t = torch.empty(*a, **k)
            ALLOCS.append((tuple(t.shape), str(t.dtype).replace("torch.", ""), hex(t.data_ptr()),
                           hex(t.data_ptr() + t.numel() * t.element_size())))
            del ALLOCS[:-40]
            return t
    fast.torch = Recorder()


def check_positions(last) -> None:
    if "pos" not in WATCH:
        return
    WATCH["kernels"] += 1
    try:
        torch.cuda.synchronize()
    except Exception as e:
        print(f"EXECUTION FAULT in kernel {WATCH['kernels']} of the forward: {list(last)[-3:]}; last gemm "
              f"{GEMM[-1:]}; pos at {hex(WATCH['pos'].data_ptr())}; {repr(e)[:100]}", flush=True)
        print("forward's allocations (shape, dtype, start, end):", ALLOCS[-14:], flush=True)
        raise
    now = WATCH["pos"].cpu()
    if not torch.equal(now, WATCH["expect"]):
        bad = (now != WATCH["expect"]).nonzero().flatten()
        print(f"POSITIONS OVERWRITTEN by kernel {WATCH['kernels']} of the forward, {list(last)[-1:]}: "
              f"{bad.numel()} of {now.numel()} changed (first at {bad[:4].tolist()}: "
              f"{now[bad[:4]].tolist()} were {WATCH['expect'][bad[:4]].tolist()}); pos at "
              f"{hex(WATCH['pos'].data_ptr())}; last launches {list(last)[-4:]}; last gemm {GEMM[-1:]}", flush=True)
        print("forward's allocations (shape, dtype, start, end):", ALLOCS[-14:], flush=True)
        WATCH.clear()


def watch_capture_phases():
    """Say which phase of torch.cuda.graph's enter/exit first reports an error, and how many Triton launches
    the capture saw (a device-wide sync around each phase outside the capture)."""
    import torch.cuda.graphs as tg
    counts = {"in_capture": 0}

    def check(phase):
        if torch.cuda.is_current_stream_capturing():
            return
        try:
            torch.cuda.synchronize()
        except Exception as e:
            print(f"PHASE {phase}: sync fails: {repr(e)[:120]}", flush=True)

    class Gc:
        def __getattr__(self, name):
            import gc as real_gc
            return getattr(real_gc, name)

        def collect(self, *a):
            import gc as real_gc
            check("before gc.collect")
            if os.environ.get("DEBUG_NO_COLLECT") == "1":       # does a finalizer run here break the capture?
                return 0
            n = real_gc.collect(*a)
            check(f"after gc.collect ({n} objects)")
            return n
    tg.gc = Gc()
    for name in ("capture_begin", "capture_end"):
        real = getattr(tg.CUDAGraph, name)

        def wrapped(self, *a, _real=real, _name=name, **k):
            check(f"before {_name}")
            try:
                out = _real(self, *a, **k)
            except Exception as e:
                print(f"PHASE {_name} raised {repr(e)[:120]}; Triton launches in capture so far "
                      f"{counts['in_capture']}", flush=True)
                raise
            check(f"after {_name}")
            return out
        setattr(tg.CUDAGraph, name, wrapped)
    real_empty = torch.cuda.empty_cache

    def empty():
        check("before empty_cache")
        real_empty()
        check("after empty_cache")
    torch.cuda.empty_cache = empty
    COUNTS.append(counts)


if os.environ.get("DEBUG_POS") == "1":
    watch_pos()
if os.environ.get("DEBUG_STALE") == "1":
    # the warm-up before a capture over the live mirror again (the behaviour before the fix of 2026-12-03, session 7)
    from laya_pool.worker.workspace import Workspace
    Workspace.blank_views = lambda self, shape: self.views(shape, 0)
if os.environ.get("DEBUG_POSWATCH") == "1":
    watch_positions()
if os.environ.get("DEBUG_LAUNCHES") == "1":
    watch_launches()
if os.environ.get("DEBUG_NARROW_ROPE") == "1":
    narrow_rope()
ck = load_checkpoint(sys.argv[1])
batches = frozen_batches(sys.argv[1])
rts = {}
for m in ("eager", "graph-fixed", "graph-cached"):
    rts[m] = Runtime(ck, device="cuda", config=RuntimeConfig(mode=m, dtype="bf16", capacity=CAP))
    print(m, "warmup", rts[m].warmup(), rts[m].forward_name, flush=True)
    torch.cuda.synchronize()
for i, b in enumerate(batches):
    outs = {}
    for m in rts:
        try:
            outs[m] = rts[m].run(b)
            if os.environ.get("DEBUG_SYNC") == "1":       # a device-wide sync after every run names the run
                torch.cuda.synchronize()
        except Exception as e:
            import traceback
            print(f"FAILED batch {i} ({b.rows} rows, longest {b.max_row_len}) in {m}: {type(e).__name__} {e}",
                  flush=True)
            traceback.print_exc()
            for last in LAUNCHES:
                print("last launches (kernel, capturing):", list(last), flush=True)
            for name, r in rts.items():
                st = r.stats()
                print(name, "capture error:", st.get("last_capture_error"), "| cache", st.get("cache"), flush=True)
            diagnose(rts)
            raise SystemExit(1) from None
    same = all(np.array_equal(o.logits, outs["eager"].logits) and np.array_equal(o.act, outs["eager"].act)
               for o in outs.values())
    print(i, "modes byte-identical", same, flush=True)
