"""A runtime's CUDA graphs made: a forward captured into a graph on the worker's stream (and released), and the
warm-up that captures what steady traffic will need before the worker reports ready (worker/runtime.py `Runtime`:
its cache calls `capture` on a miss and `release` on an eviction)."""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from laya_pool.kernels.compile import procs_for, release

from .graphs import GraphEntry
from .workspace import Shape, readbacks


class CaptureError(RuntimeError):
    """A CUDA graph capture that failed; its bucket runs eager from then on."""


def pool_bytes(pool) -> int:
    """Bytes of the segments the caching allocator holds for one private graph pool."""
    pool = tuple(pool)
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == pool)


class Capturer:
    """Captures for `rt` (a `Runtime`): its model, workspace, stream and device, and its hooks (`capture_fault`,
    `before_capture`) and launch setting (`graph_launch`), read at each capture."""

    def __init__(self, rt: Any, first: Shape):
        """`first`: the shape of the warm-up's first forward, eager (the kernels' first launches)."""
        self.rt, self.first = rt, first

    def capture(self, shape: Shape) -> GraphEntry:
        rt = self.rt
        s = rt.stream
        with torch.cuda.stream(s):
            # Warm-up on the capture stream (lazy handles, workspaces), over a mirror with no request in it: the
            # real one holds the last group, laid out for its own shape, whose rows may reach past this shape's
            # tokens: attention trusts each row's bounds and would read and write past its buffers.
            rt.model.forward(*rt.workspace.blank_views(shape), shape.row_len)
        torch.cuda.synchronize(rt.device)
        if rt.before_capture is not None:
            # Another thread's CUDA call during a (global-mode) capture breaks it: the landing watch must be done
            # with its event waits (they return at once: the device is synchronized) before the capture begins.
            rt.before_capture()
        pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        failure = None
        # No garbage collection inside the capture (torch collects once before it begins): a finalizer that frees a
        # CUDA resource (a module, an event, a host buffer) would be an illegal call in a global-mode capture.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=s):
                outputs = rt._forward(shape)
                if rt.capture_fault is not None:
                    rt.capture_fault()
        except Exception as e:
            failure = f"{type(e).__name__}: {e}"
        finally:
            if collecting:
                gc.enable()
        if failure is not None:
            # Out of the except block, so the traceback no longer pins the capture's tensors. A graph
            # whose capture failed never releases its pool by itself: release it here.
            # torch's capture_end throws before it stops routing the capture stream's allocations into the
            # pool, so later eager work on our stream would land in a pool nobody frees: stop it first.
            graph = outputs = None
            torch.cuda.synchronize(rt.device)
            try:
                torch._C._cuda_endAllocateToPool(rt.device.index, pool)
            except RuntimeError:
                pass                       # capture_end got far enough to do it itself
            torch._C._cuda_releasePool(rt.device.index, pool)
            torch.cuda.empty_cache()
            raise CaptureError(f"capture of {shape} failed: {failure}")
        torch.cuda.synchronize(rt.device)
        nbytes = pool_bytes(pool)
        extra: dict[str, Any] = {"shape": shape}
        raw = getattr(graph, "raw_cuda_graph_exec", None)      # (torch >= 2.9; older ones replay through torch)
        logits, act = outputs
        # (Only outputs the graph itself writes in place: a copy made contiguous out here would never change.)
        if rt.graph_launch == "direct" and raw is not None and logits.is_contiguous() and act.is_contiguous():
            from .cudart import graph_exec
            # What `_submit_direct` needs per launch, read once: the exec handle and its readbacks.
            extra["direct"] = (graph_exec(raw()), readbacks(logits, act, shape))
        return GraphEntry(graph=graph, outputs=outputs, pool=pool, nbytes=nbytes, extra=extra)

    def release(self, entry: GraphEntry) -> int:
        """Destroy a graph and its pool; return the bytes the driver got back (measured)."""
        rt = self.rt
        torch.cuda.synchronize(rt.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(rt.device)
        entry.graph.reset()
        entry.graph = entry.outputs = entry.pool = None
        torch.cuda.empty_cache()
        return before - torch.cuda.memory_reserved(rt.device)

    def warmup(self, progress: Callable[[int, int, str], None] | None = None,
               compilers: list | None = None) -> dict[str, float]:
        """Capture what steady traffic will need, off the request path; returns ms per step. `progress(i, n,
        what)` is called before each step (the worker logs it: a long warm-up is not silent). `compilers`: compile
        processes started already (kernels/compile.py `spawn`, the worker's first step), used instead of starting
        `procs_for(config.compile_procs)` of them here; each is reaped here, given work or not."""
        rt = self.rt
        out = {}
        if not rt.is_cuda:
            if compilers:
                release(compilers)
            return out
        say = progress or (lambda i, n, what: None)
        cached = rt.warmup_plan() if rt.config.mode == "graph-cached" else []
        fixed = rt.config.mode == "graph-fixed" and rt.fixed is None and rt.fixed_failed is None
        first = self.first
        procs = len(compilers) if compilers else procs_for(rt.config.compile_procs)
        n = 1 + (procs > 1) + fixed + len(cached)
        if procs > 1:
            say(1, n, f"kernels, compiled in {procs} processes{' started early' if compilers else ''}")
            t = time.perf_counter()
            out["compile"] = self.compile_ahead([first] + ([rt.fixed_shape] if fixed else []) + cached, procs,
                                                 compilers)
            out["compile ms"] = (time.perf_counter() - t) * 1e3
        elif compilers:
            release(compilers)
        say(1 + (procs > 1), n, "eager forward")
        t = time.perf_counter()
        with torch.cuda.stream(rt.stream):
            rt.model.forward(*rt.workspace.blank_views(first), first.row_len)
        rt.stream.synchronize()
        out["eager"] = (time.perf_counter() - t) * 1e3
        fixed_step = 2 + (procs > 1)
        if fixed:
            say(fixed_step, n, f"fixed graph {rt.fixed_shape.text()}")
            t = time.perf_counter()
            try:
                rt.fixed = self.capture(rt.fixed_shape)
            except CaptureError as e:
                rt.fixed_failed = str(e)
            out[f"fixed {rt.fixed_shape}"] = (time.perf_counter() - t) * 1e3
        for i, shape in enumerate(cached):
            say(fixed_step + fixed + i, n, f"bucket {shape.text()}")
            t = time.perf_counter()
            rt.cache.lookup(shape, count=False)
            out[f"cached {shape}"] = (time.perf_counter() - t) * 1e3
        return out

    def compile_ahead(self, shapes: list[Shape], procs: int, compilers: list | None = None) -> dict:
        """The kernels the forwards of `shapes` launch, compiled into Triton's on-disk cache by `procs` processes
        (kernels/compile.py; `compilers`: those processes, started already); the forwards here launch nothing."""
        rt = self.rt
        from laya_pool.kernels.compile import compile_in_processes, recorded, target_of, triton_knobs
        try:
            if triton_knobs() is None:
                return {"skipped": "no Triton"}
            with recorded() as specs, torch.cuda.stream(rt.stream):
                for shape in shapes:
                    rt.model.forward(*rt.workspace.blank_views(shape), shape.row_len)
            out = compile_in_processes(specs, procs, target_of(rt.device.index or 0), children=compilers)
            compilers = None          # reaped there
            return out
        except Exception as e:  # noqa: BLE001 - an optimisation: the warm-up compiles whatever this did not
            return {"error": f"{type(e).__name__}: {e}"}
        finally:
            if compilers:
                release(compilers)
