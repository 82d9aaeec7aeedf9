"""Runtime: one device's model, workspace, uploads and graph cache behind `run(batch)`.

Per request: validate the whole group on the host, pack it into the reusable staging, submit the copies
as one UploadGroup on the worker's stream, run the forward (eager, the fixed graph or a cached graph),
queue the readback, and synchronise once. A CPU runtime runs the same path eagerly, reading the staging
in place.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from kernels.fast import FastModel, supports
from kernels.reference import ReferenceModel
from protocol.contract import MODES

from .batch import Batch, Limits, RequestError, validate
from .checkpoint import Checkpoint
from .graphs import CachePolicy, GraphCache, GraphEntry
from .workspace import Capacity, Shape, Workspace

ROW_LEN_STEP = 64
# Buckets a graph-cached worker captures before it reports ready: the request classes a decision loop
# sends most (one to sixteen questions, short to full-length states), so steady traffic sees no capture.
DEFAULT_WARMUP = "1x64x2,1x64x4,1x128x4,2x128x4,4x256x4,4x256x8,8x256x8,16x512x8,16x512x16"


def parse_shapes(text: str) -> tuple[Shape, ...]:
    """`"1x64x4,16x512x8"` -> Shapes (rows x padded row length x markers per row)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            rows, row_len, markers = (int(x) for x in part.lower().split("x"))
        except ValueError as e:
            raise ValueError(f"bad shape {part!r}: expected ROWSxLENGTHxMARKERS, e.g. 4x256x8") from e
        out.append(Shape(rows, row_len, markers))
    return tuple(out)


def pool_bytes(pool) -> int:
    """Bytes of the segments the caching allocator holds for one private graph pool."""
    pool = tuple(pool)
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == pool)


class CaptureError(RuntimeError):
    """A CUDA graph capture that failed; its bucket runs eager from then on."""


def _pow2(n: int, low: int) -> int:
    return max(low, 1 << max(0, n - 1).bit_length())


@dataclass
class RunResult:
    logits: np.ndarray            # float32 [M]: each real marker's logit, rows in order
    act: np.ndarray               # float32 [R, n_act]: act probabilities
    metrics: dict[str, Any]
    taps: dict[str, np.ndarray] | None = None


@dataclass
class RuntimeConfig:
    mode: str = "eager"
    dtype: str | None = None                   # "bf16" | "fp32"; default bf16 on CUDA, fp32 on CPU
    capacity: Capacity = field(default_factory=Capacity)
    cache_policy: CachePolicy = field(default_factory=CachePolicy)
    fixed_shape: Shape | None = None           # graph-fixed: default is the capacity's largest bucket
    oversize: str = "eager"                    # graph-fixed: "eager" or "reject" for requests past its shape
    warmup_shapes: tuple[Shape, ...] = ()      # graph-cached: buckets captured at start, largest first


class Runtime:
    def __init__(self, checkpoint: Checkpoint, device: str | torch.device = "cpu", mode: str | None = None,
                 cache_policy: CachePolicy | None = None, capacity: Capacity | None = None,
                 config: RuntimeConfig | None = None):
        overrides = {k: v for k, v in (("mode", mode), ("cache_policy", cache_policy), ("capacity", capacity))
                     if v is not None}
        cfg = replace(config or RuntimeConfig(), **overrides)
        if cfg.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {cfg.mode!r}")
        self.config, self.checkpoint = cfg, checkpoint
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.is_cuda = self.device.type == "cuda"
        if not self.is_cuda and cfg.mode != "eager":
            raise ValueError(f"mode {cfg.mode!r} needs a CUDA device; a CPU worker runs eager only")
        dtype = cfg.dtype or ("bf16" if self.is_cuda else "fp32")
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        arch = checkpoint.arch
        cap = cfg.capacity
        cap = Capacity(cap.max_tokens, cap.max_rows, cap.max_markers, min(cap.row_markers, arch.max_len))
        self.capacity = cap
        self.limits = Limits(arch.vocab_size, arch.max_len, cap.max_tokens, cap.max_rows, cap.max_markers)
        # The fast path is opt-in (LAYA_FORWARD=fast) until two open findings are settled (docs/PERF.md, "Fast
        # forward"): its bf16 answers sit further from the SDK's than the reference path's, and a worker that
        # compiles its kernels from a cold Triton cache can fault the CUDA context after a graph capture.
        self.why_reference = supports(arch, self.device, self.dtype)
        if self.why_reference is None and os.environ.get("LAYA_FORWARD", "reference") != "fast":
            self.why_reference = "the fast path is opt-in: LAYA_FORWARD=fast"
        if self.why_reference is None:
            self.model = FastModel(arch, checkpoint.tensors, device=self.device, dtype=self.dtype)
        else:
            self.model = ReferenceModel(arch, checkpoint.tensors, device=self.device, dtype=self.dtype)
        self.forward_name = "fast" if self.why_reference is None else "reference"
        self.workspace = Workspace(cap, arch.n_act, self.device)
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.upload = None
        if self.is_cuda:
            from .upload import UploadGroup
            self.upload = UploadGroup(self.workspace, self.stream.cuda_stream)
        self.cache = GraphCache(cfg.cache_policy, self._capture, self._release)
        # The default fixed graph holds the "16 questions at full length" class of request.
        self.fixed_shape = cfg.fixed_shape or Shape(min(16, cap.max_rows), arch.max_len, min(32, cap.row_markers))
        self.fixed: GraphEntry | None = None
        self.fixed_failed: str | None = None
        if self.is_cuda:
            # Weights, tables and the zeroed mirror were queued on the default stream; our stream is
            # non-blocking, so make it wait once before it reads any of them.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.capture_fault = None          # test hook: called inside a capture, may break it
        self.served = 0
        self.first_call_ms: dict[str, float] = {}

    # -- identity -------------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        return self.checkpoint.fingerprint

    def card(self) -> dict[str, Any]:
        return self.checkpoint.card()

    # -- shapes ---------------------------------------------------------------------------------------
    def bucket(self, batch: Batch) -> Shape:
        cap, max_len = self.capacity, self.checkpoint.arch.max_len
        rows = min(_pow2(batch.rows, 1), cap.max_rows)
        row_len = min(-(-batch.max_row_len // ROW_LEN_STEP) * ROW_LEN_STEP, max_len)
        return Shape(rows, row_len, min(_pow2(batch.max_row_markers, 2), cap.row_markers))

    @staticmethod
    def exact(batch: Batch) -> Shape:
        return Shape(batch.rows, batch.max_row_len, batch.max_row_markers)

    # -- graphs ---------------------------------------------------------------------------------------
    def _forward(self, shape: Shape, taps: dict | None = None):
        return self.model.forward(*self.workspace.views(shape), shape.row_len, taps=taps)

    def _capture(self, shape: Shape) -> GraphEntry:
        s = self.stream
        with torch.cuda.stream(s):
            self._forward(shape)          # warm-up on the capture stream: lazy handles, workspaces
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        failure = None
        try:
            with torch.cuda.graph(graph, pool=pool, stream=s):
                outputs = self._forward(shape)
                if self.capture_fault is not None:
                    self.capture_fault()
        except Exception as e:
            failure = f"{type(e).__name__}: {e}"
        if failure is not None:
            # Out of the except block, so the traceback no longer pins the capture's tensors. A graph
            # whose capture failed never releases its pool by itself: release it here.
            # torch's capture_end throws before it stops routing the capture stream's allocations into the
            # pool, so later eager work on our stream would land in a pool nobody frees: stop it first.
            graph = outputs = None
            torch.cuda.synchronize(self.device)
            try:
                torch._C._cuda_endAllocateToPool(self.device.index, pool)
            except RuntimeError:
                pass                       # capture_end got far enough to do it itself
            torch._C._cuda_releasePool(self.device.index, pool)
            torch.cuda.empty_cache()
            raise CaptureError(f"capture of {shape} failed: {failure}")
        torch.cuda.synchronize(self.device)
        nbytes = pool_bytes(pool)
        return GraphEntry(graph=graph, outputs=outputs, pool=pool, nbytes=nbytes, extra={"shape": shape})

    def _release(self, entry: GraphEntry) -> int:
        """Destroy a graph and its pool; return the bytes the driver got back (measured)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        entry.graph.reset()
        entry.graph = entry.outputs = entry.pool = None
        torch.cuda.empty_cache()
        return before - torch.cuda.memory_reserved(self.device)

    def warmup(self, progress: Callable[[int, int, str], None] | None = None) -> dict[str, float]:
        """Capture what steady traffic will need, off the request path; returns ms per step. `progress(i, n,
        what)` is called before each step (the worker logs it: a long warm-up is not silent)."""
        out = {}
        if not self.is_cuda:
            return out
        say = progress or (lambda i, n, what: None)
        cached = []
        if self.config.mode == "graph-cached":
            cap, max_len = self.capacity, self.checkpoint.arch.max_len
            cached = sorted((sh for sh in self.config.warmup_shapes
                             if sh.rows <= cap.max_rows and sh.row_len <= max_len
                             and sh.row_markers <= cap.row_markers), reverse=True)
        fixed = self.config.mode == "graph-fixed" and self.fixed is None and self.fixed_failed is None
        n = 1 + fixed + len(cached)
        say(1, n, "eager forward")
        t = time.perf_counter()
        with torch.cuda.stream(self.stream):
            self._forward(Shape(1, ROW_LEN_STEP, 2))
        self.stream.synchronize()
        out["eager"] = (time.perf_counter() - t) * 1e3
        if fixed:
            say(2, n, f"fixed graph {_shape_text(self.fixed_shape)}")
            t = time.perf_counter()
            try:
                self.fixed = self._capture(self.fixed_shape)
            except CaptureError as e:
                self.fixed_failed = str(e)
            out[f"fixed {self.fixed_shape}"] = (time.perf_counter() - t) * 1e3
        for i, shape in enumerate(cached):
            say(2 + fixed + i, n, f"bucket {_shape_text(shape)}")
            t = time.perf_counter()
            self.cache.lookup(shape, count=False)
            out[f"cached {shape}"] = (time.perf_counter() - t) * 1e3
        return out

    # -- the request path -----------------------------------------------------------------------------
    def _plan(self, batch: Batch, mode: str) -> tuple[Shape, GraphEntry | None, dict[str, Any]]:
        if mode == "eager":
            return self.exact(batch), None, {}
        if mode == "graph-fixed":
            if self.fixed_shape.fits(batch) and self.fixed_failed is None:
                if self.fixed is None:
                    try:
                        self.fixed = self._capture(self.fixed_shape)
                    except CaptureError as e:
                        self.fixed_failed = str(e)      # the fixed graph cannot exist: serve eager from now on
                        return self.exact(batch), None, {"graph": "fixed-failed"}
                return self.fixed_shape, self.fixed, {"graph": "fixed"}
            if self.fixed_failed is not None:
                return self.exact(batch), None, {"graph": "fixed-failed"}
            if self.config.oversize == "reject":
                raise RequestError("lengths", f"request shape {self.exact(batch)} exceeds the fixed graph "
                                              f"{self.fixed_shape} and this worker rejects oversize requests")
            return self.exact(batch), None, {"graph": "oversize-eager"}
        shape = self.bucket(batch)
        hits = self.cache.counters.hits
        entry = self.cache.lookup(shape)
        state = "hit" if self.cache.counters.hits > hits else ("miss" if entry is not None else "fallback")
        return (shape if entry is not None else self.exact(batch)), entry, {"graph": state}

    def check(self, batch: Batch, mode: str | None = None, taps: bool = False) -> str:
        """Raise `RequestError` if this worker cannot run `batch` as asked; return the mode it would use."""
        validate(batch, self.limits)
        over = batch.marker_counts > self.capacity.row_markers
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise RequestError("marker_counts", f"{int(batch.marker_counts[i])} markers exceed this worker's "
                                                f"{self.capacity.row_markers} per row", i)
        mode = mode or self.config.mode
        if mode not in MODES:
            raise RequestError("mode", f"must be one of {MODES}, got {mode!r}")
        if mode != "eager" and not self.is_cuda:
            raise RequestError("mode", f"{mode!r} needs a CUDA worker; this one runs on {self.device}")
        if taps and mode != "eager":
            raise RequestError("taps", "intermediate taps are only recorded in eager mode")
        return mode

    def run(self, batch: Batch, mode: str | None = None, taps: bool = False, checked: bool = False) -> RunResult:
        """`checked=True`: the caller already ran `check` on these rows (the worker does, request by request,
        before merging them; a merged group within the capacity passes whenever its members do)."""
        t0 = time.perf_counter()
        mode = (mode or self.config.mode) if checked else self.check(batch, mode, taps)
        t1 = time.perf_counter()
        first = mode not in self.first_call_ms
        shape, entry, info = self._plan(batch, mode)
        t2 = time.perf_counter()
        spans = self.workspace.pack(batch, shape)
        t3 = time.perf_counter()
        tap_dict: dict | None = {} if taps else None
        if self.is_cuda:
            logits, act = self._run_cuda(spans, shape, entry, tap_dict)
        else:
            logits, act = self._forward(shape, tap_dict)
            self.workspace.out_logits[: logits.numel()] = logits.reshape(-1).numpy()
            self.workspace.out_act[: act.numel()] = act.reshape(-1).numpy()
        t4 = time.perf_counter()
        r, k = shape.rows, shape.row_markers
        grid = self.workspace.out_logits[: r * k].reshape(r, k)
        counts = batch.marker_counts
        cols = np.arange(counts.max())[None, :] < counts[:, None]
        out_logits = grid[: batch.rows, : cols.shape[1]][cols]
        n_act = self.checkpoint.arch.n_act
        out_act = self.workspace.out_act[: r * n_act].reshape(r, n_act)[: batch.rows].copy()
        self.served += 1
        total = (time.perf_counter() - t0) * 1e3
        if first:
            self.first_call_ms[mode] = total
        metrics = {"mode": mode, "shape": list(asdict(shape).values()), "first_call": first,
                   "validate_ms": (t1 - t0) * 1e3, "plan_ms": (t2 - t1) * 1e3, "pack_ms": (t3 - t2) * 1e3,
                   "device_ms": (t4 - t3) * 1e3, "total_ms": total, **info}
        host_taps = None
        if tap_dict is not None:
            host_taps = {name: t.detach().float().cpu().numpy() for name, t in tap_dict.items()}
        return RunResult(out_logits.astype(np.float32, copy=False), out_act, metrics, host_taps)

    def _run_cuda(self, spans, shape: Shape, entry: GraphEntry | None, taps: dict | None):
        from .cudart import memcpy_async, stream_synchronize

        s = self.stream
        handle = s.cuda_stream
        with torch.cuda.stream(s):
            self.upload.submit(spans)
            if entry is not None:
                entry.graph.replay()
                entry.replays += 1
                logits, act = entry.outputs
            else:
                logits, act = self._forward(shape, taps)
            logits, act = logits.contiguous(), act.contiguous()
            ws = self.workspace
            memcpy_async(ws.out_logits.ctypes.data, logits.data_ptr(), 4 * logits.numel(), False, handle)
            memcpy_async(ws.out_act.ctypes.data, act.data_ptr(), 4 * act.numel(), False, handle)
            stream_synchronize(handle)
        return logits, act

    def stats(self) -> dict[str, Any]:
        return {"served": self.served, "mode": self.config.mode, "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "forward": self.forward_name,
                "cache": asdict(self.cache.counters),
                "cached_shapes": [list(asdict(k).values()) for k in self.cache.keys()],
                "first_call_ms": dict(self.first_call_ms), "fixed_failed": self.fixed_failed,
                "last_capture_error": self.cache.last_error,
                "uploads": None if self.upload is None else {"submitted": self.upload.submitted,
                                                             "drains": self.upload.drains}}

    def close(self) -> None:
        if self.is_cuda:
            self.cache.clear()
            if self.fixed is not None:
                self._release(self.fixed)
                self.fixed = None
            self.stream.synchronize()
        self.workspace.close()


def _shape_text(shape: Shape) -> str:
    """ROWSxLENGTHxMARKERS, as --warmup-shapes writes a bucket."""
    return f"{shape.rows}x{shape.row_len}x{shape.row_markers}"
