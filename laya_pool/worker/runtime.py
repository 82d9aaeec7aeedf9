"""Runtime: one device's model, workspace, uploads and graph cache behind `launch(batch)` / `finish(job)`.

Per group: validate on the host, pack into a free staging slot, submit the copies as one UploadGroup on the
worker's stream, queue the forward (eager, the fixed graph or a cached graph) and the readback into the slot,
and record the slot's done event: that is `launch`, which returns without waiting. `finish` waits for the
event and cuts the answers out of the slot. With two slots (CUDA, `overlap=True`) the compute thread launches
group N+1 before it finishes group N, so the device never waits for the host's validation and packing
(docs/architecture.md, "Overlap"). `run` is both in a row. A CPU runtime runs the same path eagerly inside
`launch`, reading the staging in place, with one slot. Graphs are captured, released and warmed up by
worker/capture.py's `Capturer`; the bucket a group runs in is chosen here (`_plan`).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from laya_pool.kernels import cublas
from laya_pool.kernels.fast import FastModel, supports
from laya_pool.kernels.reference import ReferenceModel
from laya_pool.protocol import settings
from laya_pool.protocol.contract import MODES

from .batch import Batch, Limits, RequestError, validate_structure, validate_values
from .capture import CaptureError, Capturer
from .checkpoint import Checkpoint
from .graphs import CachePolicy, GraphCache, GraphEntry, smallest_cover
from .slots import SlotLedger, SlotState
from .workspace import Capacity, Shape, Workspace, readbacks

# A bucket's row length is a multiple of this. The fast forward computes rows x row_len packed token slots, so the
# step is paid in every row of a merged group: at 64, a group of 32 one-question requests of 48 tokens ran 2,048
# slots for 1,536 tokens (docs/decisions/0012-graph-bucket-steps.md). 16 keeps the number of buckets a traffic mix
# can make bounded (a miss runs in the smallest held bucket that covers it and is captured when idle) and cuts that
# padding to at most 15.
ROW_LEN_STEP = 16
# Buckets a graph-cached worker captures before it reports ready: the request classes a decision loop
# sends most (one to sixteen questions, short to full-length states), so steady traffic sees no capture.
DEFAULT_WARMUP = "1x64x2,1x64x4,1x128x4,2x128x4,4x256x4,4x256x8,8x256x8,16x512x8,16x512x16"
# Request classes whose merged groups the default warm-up also captures (ROWSxTOKENSxMARKERS of one request, as
# it arrives): one question over a short or a medium state (bench.py's and load.py's 1x48 and 1x128 both carry a
# four-option question; 64: what 49-64 tokens make since buckets step by 16). A worker merging up to --max-batch
# of them runs buckets of 1, 2, 4, 8, 16, 24, ... rows (`bucket_rows`).
DEFAULT_MERGED = "1x48x4,1x64x4,1x128x4"
CAPTURE_MODES = ("idle", "inline")    # a missed bucket: captured when no request waits, or by the request
MISSED_LISTED = 16                    # missed buckets status lists (the most missed first)


def read_back(out: Any, copies: tuple[tuple[int, int, int], ...], stream: int) -> None:
    """Queue `copies` (workspace.readbacks) from the device into slot outputs `out` on `stream`."""
    from .cudart import memcpy_async  # (the CUDA runtime's bindings: only where a device is)

    base = out.out.ctypes.data
    for at, src, nbytes in copies:
        memcpy_async(base + at, src, nbytes, False, stream)


def parse_shapes(text: str) -> tuple[Shape, ...]:
    """`"1x64x4,16x512x8"` -> Shapes (rows x padded row length x markers per row)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            rows, row_len, markers = (int(x) for x in part.lower().split("x"))
        except ValueError as e:
            raise ValueError(f"bad shape {part!r}: expected ROWSxLENGTHxMARKERS, e.g. 4x256x8") from e
        if min(rows, row_len, markers) < 1:
            raise ValueError(f"bad shape {part!r}: rows, length and markers must be positive")
        out.append(Shape(rows, row_len, markers))
    return tuple(out)


def _pow2(n: int, low: int) -> int:
    return max(low, 1 << max(0, n - 1).bit_length())


# Past this many rows a bucket's rows step by it instead of doubling. A forward computes every row of its bucket, so
# doubling padded the 20 rows of a merged group of five 4x256 requests to 32: 60% more tokens, and
# once the mix's large buckets were captured its load ran 15% slower than when they ran eager at their exact shape.
# Steps of 8 pad at most 7 rows and add one bucket per 8 rows past 8; with them that load ran 16% faster, READY
# unchanged (H100; docs/decisions/0012-graph-bucket-steps.md).
ROW_STEP = 8


def bucket_rows(rows: int) -> int:
    """A bucket's rows: a power of two up to ROW_STEP, then the next multiple of ROW_STEP; pure."""
    return _pow2(rows, 1) if rows <= ROW_STEP else -(-rows // ROW_STEP) * ROW_STEP


def bucket_of(rows: int, row_len: int, row_markers: int, cap: Capacity, max_len: int) -> Shape:
    """The graph bucket of a batch: rows as `bucket_rows`, markers per row to a power of two, the row length to a
    multiple of ROW_LEN_STEP."""
    return Shape(min(bucket_rows(rows), cap.max_rows), min(-(-row_len // ROW_LEN_STEP) * ROW_LEN_STEP, max_len),
                 min(_pow2(row_markers, 2), cap.row_markers))


# A cover whose rows pad a bucket's rows by at most this many tokens is kept as that bucket's graph: what every
# bucket cost when lengths rounded to 64, so finer steps never make more captures than they did then.
COVER_SLACK = 64


def settles(shape: Shape, cover: Shape) -> bool:
    """Whether `cover` (a held bucket that holds `shape`) serves `shape` for good, with no capture of its own: the
    same rows x length (only more marker slots), or the same rows no longer than `shape`'s length rounded up to a
    multiple of COVER_SLACK (the bucket the old rule made); pure."""
    if cover.rows * cover.row_len == shape.rows * shape.row_len:
        return True
    return cover.rows == shape.rows and cover.row_len <= -(-shape.row_len // COVER_SLACK) * COVER_SLACK


def merged_buckets(classes: tuple[Shape, ...], max_group: int, cap: Capacity, max_len: int) -> list[Shape]:
    """The buckets groups of 1..`max_group` requests of each class produce, as worker.merge admits them.

    A class is one request's exact shape (rows, tokens per row, markers per row). A group of n such requests
    has n x rows rows of the same length and markers; it stops growing where Group.admits would refuse it."""
    out: set[Shape] = set()
    for c in classes:
        if c.row_len > max_len or c.row_markers > cap.row_markers:
            continue
        for n in range(1, max_group + 1):
            rows = n * c.rows
            if rows > cap.max_rows or rows * c.row_len > cap.max_tokens or rows * c.row_markers > cap.max_markers:
                break
            out.add(bucket_of(rows, c.row_len, c.row_markers, cap, max_len))
    return sorted(out)


def warmup_plan(shapes: tuple[Shape, ...], classes: tuple[Shape, ...], max_group: int, cap: Capacity,
                max_len: int, settled: bool = False) -> list[Shape]:
    """Every bucket to capture before READY, largest first: the named shapes and the merged classes' buckets,
    each within the capacity and the model's row length. `settled`: without those whose rows and length another
    planned bucket has, with more marker slots (8x256x4 beside 8x256x8: the same work, `settles`), for a runtime
    that serves a miss from such a cover. (One of the same rows, only longer, would cost tokens: 1x48 stays beside
    1x64.)"""
    named = [sh for sh in shapes if sh.rows <= cap.max_rows and sh.row_len <= max_len
             and sh.row_markers <= cap.row_markers]
    plan = sorted(set(named) | set(merged_buckets(classes, max_group, cap, max_len)), reverse=True)
    if settled:
        plan = [sh for sh in plan if not any((c.rows, c.row_len) == (sh.rows, sh.row_len)
                                             and c.row_markers > sh.row_markers for c in plan)]
    return plan


@dataclass
class RunResult:
    logits: np.ndarray            # float32 [M]: each real marker's logit, rows in order
    act: np.ndarray               # float32 [R, n_act]: act probabilities
    metrics: dict[str, Any]
    taps: dict[str, np.ndarray] | None = None


@dataclass
class Launched:
    """A group on its way through the device: what `finish` needs to answer it."""
    batch: Batch
    mode: str
    shape: Shape
    slot: int
    info: dict[str, Any]
    first: bool
    times: tuple[float, float, float, float]   # started, checked, planned, packed (perf_counter)
    outputs: tuple                             # the forward's device outputs, alive until the readback is done
    taps: dict | None
    event: Any | None                          # the slot's done event (None on the CPU: done inside launch)
    landed: Any = None                         # a threading.Event when a LandingWatch waits on `event` instead
    error: BaseException | None = None         # what the watch's wait raised
    landed_at: float | None = None             # time.monotonic() when this host first saw `event` done

    def done(self) -> bool:
        """True once the readback landed in the slot (never blocks). The first call that sees it landed stamps
        `landed_at`: a landing the compute thread notices while forming the next group (the data socket's poll) is
        then not stamped at the later `finish`, after that group's launch (tools/load.py's idle time)."""
        if self.landed is not None:
            return self.landed.is_set()
        if self.event is None:          # the CPU computed inside launch
            return True
        if self.event.done():
            if self.landed_at is None:
                self.landed_at = time.monotonic()
            return True
        return False


@dataclass
class RuntimeConfig:
    mode: str = "eager"
    dtype: str | None = None                   # "bf16" | "fp32"; default bf16 on CUDA, fp32 on CPU
    capacity: Capacity = field(default_factory=Capacity)
    cache_policy: CachePolicy = field(default_factory=CachePolicy)
    fixed_shape: Shape | None = None           # graph-fixed: default is the capacity's largest bucket
    oversize: str = "eager"                    # graph-fixed: "eager" or "reject" for requests past its shape
    warmup_shapes: tuple[Shape, ...] = ()      # graph-cached: buckets captured at start, largest first
    warmup_merged: tuple[Shape, ...] = ()      # graph-cached: request classes whose merged groups' buckets too
    warmup_group: int = 1                      # ... merged up to this many requests (the worker's --max-batch)
    capture: str = "inline"                    # graph-cached miss: "inline" (the request waits) or "idle"
    # Two staging slots, so group N+1 launches before N finishes. Default: on CUDA; not on the CPU, whose forward
    # runs inside launch (nothing to overlap; tests turn it on there to drive the two-group loop).
    overlap: bool | None = None
    # Processes that compile the warm-up's kernels in parallel before it runs (kernels/compile.py), on a machine whose
    # Triton cache does not hold them yet. None (default): one per spare core, at most 8 (`procs_for`); 0 or 1: off.
    compile_procs: int | None = None


class Runtime:
    def __init__(self, checkpoint: Checkpoint, device: str | torch.device = "cpu", mode: str | None = None,
                 cache_policy: CachePolicy | None = None, capacity: Capacity | None = None,
                 config: RuntimeConfig | None = None):
        overrides = {k: v for k, v in (("mode", mode), ("cache_policy", cache_policy), ("capacity", capacity))
                     if v is not None}
        cfg = replace(config or RuntimeConfig(), **overrides)
        if cfg.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {cfg.mode!r}")
        if cfg.capture not in CAPTURE_MODES:
            raise ValueError(f"capture must be one of {CAPTURE_MODES}, got {cfg.capture!r}")
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
        self._choose_forward(arch, checkpoint)
        self._open_device(cap, arch.n_act, self.is_cuda if cfg.overlap is None else cfg.overlap)
        self.capturer = Capturer(self, Shape(1, ROW_LEN_STEP, 2))
        self.cache = GraphCache(cfg.cache_policy, self.capturer.capture, self.capturer.release)
        # The default fixed graph holds the "16 questions at full length" class of request.
        self.fixed_shape = cfg.fixed_shape or Shape(min(16, cap.max_rows), arch.max_len, min(32, cap.row_markers))
        self.fixed: GraphEntry | None = None
        self.fixed_failed: str | None = None
        if self.is_cuda:
            # Weights, tables and the zeroed mirror were queued on the default stream; our stream is
            # non-blocking, so make it wait once before it reads any of them.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.capture_fault = None          # test hook: called inside a capture, may break it
        self.before_capture = None         # set by the compute thread: quiesce its landing watch
        self.served = 0
        self.first_call_ms: dict[str, float] = {}

    def _choose_forward(self, arch: Any, checkpoint: Checkpoint) -> None:
        """The model: the fast forward where it runs, else the reference (`why_reference`); how graphs launch."""
        # The fast path wherever it runs (CUDA, bf16): its answers are the reference path's (large preset: 99.22% of
        # the SDK's decisions, every decisive one) at 3.7x the speed at 1x48 (graph replay, H200).
        # LAYA_FORWARD=reference keeps the reference forward.
        forward = settings.get("LAYA_FORWARD")
        self.why_reference = supports(arch, self.device, self.dtype)
        if self.why_reference is None and forward == "reference":
            self.why_reference = "LAYA_FORWARD=reference"
        if self.why_reference is None:
            self.model = FastModel(arch, checkpoint.tensors, device=self.device, dtype=self.dtype)
        else:
            self.model = ReferenceModel(arch, checkpoint.tensors, device=self.device, dtype=self.dtype)
        self.forward_name = "fast" if self.why_reference is None else "reference"
        # How a captured graph is launched: "direct" (cudaGraphLaunch on the worker's stream through cuda-python, no
        # torch call on the way) or "torch" (CUDAGraph.replay inside the stream's context). Same graph, same stream,
        # same bits (tests/test_runtime_gpu.py); direct takes 19-20 us less host time a launch (H100 host, 63.8 ->
        # 44.7 us at 1x48, 82.5 -> 62.3 at 32x48; docs/decisions/0009-launches-without-tritons-dispatch.md).
        self.graph_launch = settings.get("LAYA_GRAPH_LAUNCH")
        self.direct_launches = 0
        # What an operator reads in the start-up log and the status: which forward, and for the fast path its
        # attention and GELU (kernels/fast.py, kernels/exact.py); for the reference, why.
        if self.why_reference is None:
            gelu = "table" if self.model.exactness.get("gelu_table") else "libdevice"
            self.forward_detail = f"fast (attention {self.model.attention}, GELU {gelu})"
        else:
            self.forward_detail = f"reference ({self.why_reference})"

    def _open_device(self, cap: Capacity, n_act: int, overlap: bool) -> None:
        """The staging slots (two with `overlap`), the worker's stream, the uploads and the slots' done events."""
        # Two slots let the host pack group N+1 while group N computes; the CPU computes inside launch: one.
        self.workspace = Workspace(cap, n_act, self.device, slots=2 if overlap else 1)
        self.slots = SlotLedger(len(self.workspace.slots))
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        if self.is_cuda and self.why_reference is None:
            cublas.workspace(self.stream)
        self.upload = None
        self.events: list[Any] = []
        if self.is_cuda:
            from .cudart import Event
            from .upload import UploadGroup
            self.upload = UploadGroup(self.workspace, self.stream.cuda_stream)
            self.events = [Event() for _ in self.workspace.slots]

    # -- identity -------------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        return self.checkpoint.fingerprint

    def card(self) -> dict[str, Any]:
        return self.checkpoint.card()

    # -- shapes ---------------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Groups that may be launched and not yet finished at once."""
        return self.slots.n

    @property
    def row_len_step(self) -> int:
        """What a row's length is padded to a multiple of: the bucket step where graphs are cached by bucket."""
        return ROW_LEN_STEP if self.config.mode == "graph-cached" else 1

    def bucket(self, batch: Batch) -> Shape:
        return bucket_of(batch.rows, batch.max_row_len, batch.max_row_markers, self.capacity,
                         self.checkpoint.arch.max_len)

    def warmup_plan(self) -> list[Shape]:
        cfg = self.config
        # A capture made only to be covered by a larger one costs start time and memory; an inline runtime captures
        # a miss instead of taking a cover, so it keeps every bucket.
        return warmup_plan(cfg.warmup_shapes, cfg.warmup_merged, cfg.warmup_group, self.capacity,
                           self.checkpoint.arch.max_len, settled=cfg.capture == "idle")

    @staticmethod
    def exact(batch: Batch) -> Shape:
        return Shape(batch.rows, batch.max_row_len, batch.max_row_markers)

    # -- graphs ---------------------------------------------------------------------------------------
    def _forward(self, shape: Shape, taps: dict | None = None, slot: int = 0):
        return self.model.forward(*self.workspace.views(shape, slot), shape.row_len, taps=taps)

    def warmup(self, progress: Callable[[int, int, str], None] | None = None,
               compilers: list | None = None) -> dict[str, float]:
        """Capture what steady traffic will need, off the request path (worker/capture.py `Capturer.warmup`)."""
        return self.capturer.warmup(progress, compilers)

    @property
    def has_idle_work(self) -> bool:
        """A missed bucket waits for a capture (graph-cached, capture="idle")."""
        return bool(self.cache.pending)

    def idle_work(self) -> Shape | None:
        """Capture one missed bucket; call only when no request waits and nothing is launched."""
        if self.slots.in_flight:
            raise RuntimeError("idle_work with a group in flight: finish it first")
        return self.cache.capture_pending()

    # -- the request path -----------------------------------------------------------------------------
    def _plan(self, batch: Batch, mode: str) -> tuple[Shape, GraphEntry | None, dict[str, Any]]:
        if mode == "eager":
            return self.exact(batch), None, {}
        if mode == "graph-fixed":
            if self.fixed_shape.fits(batch) and self.fixed_failed is None:
                if self.fixed is None:
                    try:
                        self.fixed = self.capturer.capture(self.fixed_shape)
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
        if self.config.capture == "inline":
            hits = self.cache.counters.hits
            entry = self.cache.lookup(shape)
            state = "hit" if self.cache.counters.hits > hits else ("miss" if entry is not None else "fallback")
            return (shape if entry is not None else self.exact(batch)), entry, {"graph": state}
        entry = self.cache.get(shape)
        if entry is not None:
            return shape, entry, {"graph": "hit"}
        # A miss never waits for a capture: a captured bucket that holds it gives the same bits; else eager.
        # The bucket is captured once no request waits (`idle_work`), unless its cover is close enough (`settles`).
        cover = smallest_cover(shape, self.cache.keys())
        if cover is not None and settles(shape, cover):
            self.cache.counters.covered += 1
            return cover, self.cache.use(cover), {"graph": "covered"}
        cacheable = self.cache.defer(shape)
        if cover is not None:
            self.cache.counters.covered += 1
            return cover, self.cache.use(cover), {"graph": "covered"}
        self.cache.counters.fallbacks += 1
        return self.exact(batch), None, {"graph": "deferred" if cacheable else "fallback"}

    def check(self, batch: Batch, mode: str | None = None, taps: bool = False) -> str:
        """Raise `RequestError` if this worker cannot run `batch` as asked; return the mode it would use. In the
        worker's order: the request (`check_request`), then its rows' values (`check_values`)."""
        mode = self.check_request(batch, mode, taps)
        self.check_values(batch)
        return mode

    def check_request(self, batch: Batch, mode: str | None = None, taps: bool = False, parsed: bool = False) -> str:
        """`check` but for the values of rows and tokens (`check_values`): a worker checks those once for a merged
        group (worker/batch.py `validate_structure` says why that is the same, and what `parsed` skips)."""
        validate_structure(batch, self.limits, parsed)
        mode = mode or self.config.mode
        if mode not in MODES:
            raise RequestError("mode", f"must be one of {MODES}, got {mode!r}")
        if mode != "eager" and not self.is_cuda:
            raise RequestError("mode", f"{mode!r} needs a CUDA worker; this one runs on {self.device}")
        if taps and mode != "eager":
            raise RequestError("taps", "intermediate taps are only recorded in eager mode")
        return mode

    def check_values(self, batch: Batch) -> None:
        """The values of each row and token of `batch`, whose structure passed (`validate_structure`)."""
        validate_values(batch, self.limits)
        if batch.max_row_markers > self.capacity.row_markers:
            i = int(np.flatnonzero(batch.marker_counts > self.capacity.row_markers)[0])
            raise RequestError("marker_counts", f"{int(batch.marker_counts[i])} markers exceed this worker's "
                                                f"{self.capacity.row_markers} per row", i)

    def run(self, batch: Batch, mode: str | None = None, taps: bool = False, checked: bool = False) -> RunResult:
        """`checked=True`: the caller already checked these rows (the worker: each request's `check_request` on
        arrival, the merged group's `check_values` before it runs; worker/compute.py `_valid`)."""
        return self.finish(self.launch(batch, mode, taps, checked))

    def launch(self, batch: Batch, mode: str | None = None, taps: bool = False, checked: bool = False) -> Launched:
        """Pack `batch` into a free slot and queue its copies, forward and readback; returns without waiting.
        Raises `SlotError` if every slot holds a group (finish one first), `UploadError` after draining."""
        t0 = time.perf_counter()
        mode = (mode or self.config.mode) if checked else self.check(batch, mode, taps)
        t1 = time.perf_counter()
        first = mode not in self.first_call_ms
        shape, entry, info = self._plan(batch, mode)
        t2 = time.perf_counter()
        slot = self.slots.acquire()
        tap_dict: dict | None = {} if taps else None
        try:
            spans = self.workspace.pack(batch, shape, slot)
            t3 = time.perf_counter()
            if self.is_cuda:
                outputs = self._submit(spans, shape, entry, tap_dict, slot)
            else:
                logits, act = outputs = self._forward(shape, tap_dict, slot)
                out_logits, out_act = self.workspace.outputs(slot, shape)
                out_logits[:] = logits.reshape(-1).numpy()
                out_act[:] = act.reshape(-1).numpy()
                self.slots.submitted(slot)
        except BaseException:
            self._abandon(slot)
            raise
        return Launched(batch, mode, shape, slot, info, first, (t0, t1, t2, t3), outputs, tap_dict,
                        self.events[slot] if self.is_cuda else None)

    def finish(self, job: Launched) -> RunResult:
        """Wait for `job`'s readback, cut its answers out of the slot and free the slot (also when it fails)."""
        try:
            if job.landed is not None:
                job.landed.wait()          # the landing watch owns the event until it sets this
                if job.error is not None:
                    raise job.error
            elif job.event is not None:
                job.event.wait()
                if job.landed_at is None:       # (stamped already where `done` saw it land)
                    job.landed_at = time.monotonic()
            t4 = time.perf_counter()
            return self._answers(job, t4)
        finally:
            job.outputs = None
            self.slots.release(job.slot)

    def _answers(self, job: Launched, t4: float) -> RunResult:
        batch, shape = job.batch, job.shape
        t0, t1, t2, t3 = job.times
        n_act = self.checkpoint.arch.n_act
        r, k = shape.rows, shape.row_markers
        logits, act = self.workspace.outputs(job.slot, shape)
        grid = logits.reshape(r, k)
        counts = batch.marker_counts
        if batch.rows == 1:             # a lone row (most small requests): a slice, 2.5 us less than the mask below
            out_logits = grid[0, : int(counts[0])].copy()
        else:
            cols = np.arange(counts.max())[None, :] < counts[:, None]
            out_logits = grid[: batch.rows, : cols.shape[1]][cols]          # fancy indexing: a copy
        out_act = act.reshape(r, n_act)[: batch.rows].copy()
        self.served += 1
        total = (time.perf_counter() - t0) * 1e3
        if job.first:
            self.first_call_ms[job.mode] = total
        # device_ms: from the packed slot to its answers in host memory, including any wait behind the group
        # launched before it (that group's compute is what the overlap hides this group's host work behind).
        # (the shape's fields by hand: dataclasses.asdict copies recursively, 3 us a call)
        metrics = {"mode": job.mode, "shape": [shape.rows, shape.row_len, shape.row_markers], "first_call": job.first,
                   "validate_ms": (t1 - t0) * 1e3, "plan_ms": (t2 - t1) * 1e3, "pack_ms": (t3 - t2) * 1e3,
                   "device_ms": (t4 - t3) * 1e3, "total_ms": total, **job.info}
        host_taps = None
        if job.taps is not None:
            host_taps = {name: t.detach().float().cpu().numpy() for name, t in job.taps.items()}
        return RunResult(out_logits.astype(np.float32, copy=False), out_act, metrics, host_taps)

    def _submit(self, spans, shape: Shape, entry: GraphEntry | None, taps: dict | None, slot: int) -> tuple:
        """Queue the group on the stream: upload from the slot, forward, readback into the slot, done event."""
        s = self.stream
        handle = s.cuda_stream
        out = self.workspace.slots[slot]
        direct = None if entry is None else entry.extra.get("direct")
        # (cudaGraphLaunch takes no device: only with the runtime's device current, as a worker's one visible GPU is)
        if direct is not None and torch.cuda.current_device() == self.device.index:
            return self._submit_direct(spans, entry, direct, handle, out, slot)
        with torch.cuda.stream(s):
            self.upload.submit(spans, slot)        # a failed upload drains before raising: the slot stays PACKING
            self.slots.submitted(slot)             # from here copies may read the slot: the host keeps off it
            if entry is not None:
                entry.graph.replay()
                entry.replays += 1
                logits, act = entry.outputs
            else:
                logits, act = self._forward(shape, taps)
            logits, act = logits.contiguous(), act.contiguous()
            read_back(out, readbacks(logits, act, shape), handle)
            self.events[slot].record(handle)
        # Eager outputs must live until the readback ran; a graph's outputs belong to its entry (holding them here
        # would keep an evicted graph's pool segment reserved until this group is answered).
        return (logits, act) if entry is None else ()

    def _submit_direct(self, spans, entry: GraphEntry, direct: tuple, handle: int, out, slot: int) -> tuple:
        """`_submit` for a captured graph launched with cudaGraphLaunch (LAYA_GRAPH_LAUNCH=direct): every call takes
        the worker's stream explicitly, so no torch stream context is entered."""
        from .cudart import graph_launch

        exec_, copies = direct
        self.upload.submit(spans, slot)
        self.slots.submitted(slot)
        graph_launch(exec_, handle)
        entry.replays += 1
        self.direct_launches += 1
        read_back(out, copies, handle)
        self.events[slot].record(handle)
        return ()

    def _abandon(self, slot: int) -> None:
        """Free the slot of a launch that raised. Copies already queued may still read it: drain them first."""
        if self.is_cuda and self.slots.states[slot] is SlotState.QUEUED:
            from .cudart import CudaError, stream_synchronize
            try:
                stream_synchronize(self.stream.cuda_stream)
            except CudaError:
                pass      # the device is broken: the launch's own error says so, and the worker goes fatal
        self.slots.release(slot)

    def stats(self) -> dict[str, Any]:
        return {"served": self.served, "mode": self.config.mode, "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "forward": self.forward_name,
                "forward_detail": self.forward_detail,
                "cache": asdict(self.cache.counters),
                "cached_shapes": [list(asdict(k).values()) for k in self.cache.keys()],
                "first_call_ms": dict(self.first_call_ms), "fixed_failed": self.fixed_failed,
                "last_capture_error": self.cache.last_error,
                "uploads": None if self.upload is None else {"submitted": self.upload.submitted,
                                                             "drains": self.upload.drains},
                "slots": self.slots.n, "launched": self.slots.launched, "pending_captures": len(self.cache.pending),
                # The buckets traffic missed most, captured since or not: what the warm-up options could name.
                "missed_shapes": [[k.text(), n] for k, n in sorted(self.cache.missed.items(),
                                                                          key=lambda kv: -kv[1])[:MISSED_LISTED]],
                "graph_launch": self.graph_launch, "direct_launches": self.direct_launches}

    def close(self) -> None:
        if self.is_cuda:
            self.cache.clear()
            if self.fixed is not None:
                self.capturer.release(self.fixed)
                self.fixed = None
            self.stream.synchronize()
            for ev in self.events:
                ev.close()
            self.events = []
        self.workspace.close()
