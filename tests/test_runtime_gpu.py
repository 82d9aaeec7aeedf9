"""Worker runtime on a real GPU: pinned staging, grouped uploads, eager and graph modes, the graph cache.

Run on the device: `python -m pytest -q -m gpu tests/test_runtime_gpu.py -s`.
"""
import gc
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from laya_pool.worker.batch import Batch
from laya_pool.worker.checkpoint import load_checkpoint
from laya_pool.worker.graphs import CachePolicy
from laya_pool.worker.runtime import Runtime, RuntimeConfig
from laya_pool.worker.upload import UploadError
from laya_pool.worker.workspace import Capacity, Shape

pytestmark = pytest.mark.gpu
CASES = Path(__file__).parents[1] / "laya_pool/tools/cases/requests.json"
CAP = Capacity(max_tokens=16 * 512, max_rows=16, max_markers=1024, row_markers=64)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return load_checkpoint(tiny_ckpt)


def frozen_batches(tiny_ckpt) -> list[Batch]:
    from laya_pool.client.card import ModelCard
    from laya_pool.client.semantics import encode_request
    card = ModelCard.from_dir(tiny_ckpt)
    cases = json.loads(CASES.read_text())["cases"]
    out = [Batch.from_rows(encode_request(card, c["state"], c["questions"]).rows) for c in cases]
    rng = np.random.default_rng(0)
    for rows, length in ((1, 48), (4, 256), (16, 512), (5, 65), (3, 64)):
        out.append(Batch.from_rows([(rng.integers(5, 1000, length).astype(np.int32),
                                     np.sort(rng.choice(np.arange(1, length), 4, replace=False)).astype(np.int32),
                                     int(rng.integers(0, 3))) for _ in range(rows)]))
    return out


def runtime(ckpt, mode, dtype="bf16", **kw) -> Runtime:
    cfg = RuntimeConfig(mode=mode, dtype=dtype, capacity=CAP, **kw)
    rt = Runtime(ckpt, device="cuda", config=cfg)
    rt.warmup()
    return rt


def test_a_cuda_worker_runs_the_fast_path_with_its_own_attention_by_default(ckpt, monkeypatch):
    """The default on CUDA in bf16 (docs/decisions/0004-attention-in-cudnns-order.md); LAYA_FORWARD=reference and
    LAYA_ATTN=sdpa choose otherwise, and the runtime says so."""
    for env, want in (({}, "fast (attention triton"), ({"LAYA_ATTN": "sdpa"}, "fast (attention sdpa"),
                      ({"LAYA_FORWARD": "reference"}, "reference (LAYA_FORWARD=reference)")):
        for k in ("LAYA_ATTN", "LAYA_FORWARD"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        rt = Runtime(ckpt, device="cuda", config=RuntimeConfig(mode="eager", capacity=CAP))
        try:
            assert rt.forward_detail.startswith(want), (env, rt.forward_detail)
        finally:
            rt.close()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_modes_are_byte_identical(ckpt, tiny_ckpt, dtype):
    batches = frozen_batches(tiny_ckpt)
    rts = {m: runtime(ckpt, m, dtype) for m in ("eager", "graph-fixed", "graph-cached")}
    worst = {}
    for order in (list(rts), list(reversed(rts))):
        for i, b in enumerate(batches):
            outs = {m: rts[m].run(b) for m in order}
            ref = outs["eager"]
            assert np.isfinite(ref.logits).all() and np.isfinite(ref.act).all()
            for m, o in outs.items():
                d = max(float(np.abs(o.logits - ref.logits).max()), float(np.abs(o.act - ref.act).max()))
                worst[m] = max(worst.get(m, 0.0), d)
                assert np.array_equal(o.logits, ref.logits) and np.array_equal(o.act, ref.act), (dtype, m, i, d)
    print(f"\nmodes byte-identical ({dtype}) over {len(batches)} batches x 2 orders; worst |d| {worst}")


def test_launches_without_tritons_dispatch_give_its_bits(ckpt, tiny_ckpt, monkeypatch):
    """Eager mode launches its kernels through kernels/launch.py's cache (compiled kernels called directly, GEMM plans)
    by default: the same bits as every launch through Triton's dispatch, on every frozen batch, and the cache is hit
    (the second pass over the batches adds no entry)."""
    from laya_pool.kernels import gemm, launch
    batches = frozen_batches(tiny_ckpt)
    rt = runtime(ckpt, "eager")
    try:
        launch.forget()
        first = [rt.run(b) for b in batches]
        held = (len(gemm._PLANS), len(launch._ENTRIES))
        again = [rt.run(b) for b in batches]
        assert held[0] > 0 and held[1] > 0 and (len(gemm._PLANS), len(launch._ENTRIES)) == held, held
        monkeypatch.setenv("LAYA_LAUNCH_CACHE", "0")
        off = [rt.run(b) for b in batches]
    finally:
        rt.close()
    for i, (a, b, c) in enumerate(zip(first, again, off)):
        for o in (a, b):
            assert np.array_equal(o.logits, c.logits) and np.array_equal(o.act, c.act), i
    print(f"\nlaunch cache: {held[0]} GEMM plans, {held[1]} other launches; bits = Triton's dispatch on "
          f"{len(batches)} batches")


def test_graphs_launched_directly_give_torchs_replay_bits(ckpt, tiny_ckpt, monkeypatch):
    """LAYA_GRAPH_LAUNCH=direct launches each captured graph with cudaGraphLaunch on the worker's stream (no torch
    stream context, no CUDAGraph.replay): the same answers as torch's replay on every frozen batch, in graph-cached
    and graph-fixed mode, and the direct path is the one taken. The batches alternate shapes and contents, so a launch
    that ran nothing, or ran on another stream than the readback's, would return the batch before's answers."""
    batches = frozen_batches(tiny_ckpt)
    for mode in ("graph-cached", "graph-fixed"):
        monkeypatch.setenv("LAYA_GRAPH_LAUNCH", "torch")
        ref_rt = runtime(ckpt, mode)
        monkeypatch.setenv("LAYA_GRAPH_LAUNCH", "direct")
        rt = runtime(ckpt, mode)
        try:
            ref = [ref_rt.run(b) for b in batches]
            for _ in range(2):
                for i, b in enumerate(batches):
                    o = rt.run(b)
                    assert np.array_equal(o.logits, ref[i].logits) and np.array_equal(o.act, ref[i].act), (mode, i)
            graphed = sum(r.metrics.get("graph") in ("hit", "miss", "covered", "fixed") for r in ref)
            assert graphed > 0 and rt.direct_launches == 2 * graphed, (mode, graphed, rt.direct_launches)
            assert ref_rt.direct_launches == 0
        finally:
            rt.close()
            ref_rt.close()
        print(f"\ndirect graph launches ({mode}): {2 * graphed} launches, bits = torch's replay on {len(batches)} "
              "batches")
    monkeypatch.setenv("LAYA_GRAPH_LAUNCH", "replay")
    with pytest.raises(ValueError, match="LAYA_GRAPH_LAUNCH"):
        Runtime(ckpt, device="cuda", config=RuntimeConfig(mode="eager", capacity=CAP))


def test_merged_requests_answer_byte_identically(ckpt, tiny_ckpt):
    """What makes a worker's dynamic batching safe on CUDA: a request merged with others answers exactly
    what it answers alone, in every mode (worker/merge.py)."""
    from laya_pool.worker.merge import Group
    batches = [b for b in frozen_batches(tiny_ckpt) if b.rows <= 4 and b.tokens <= 1024]
    rng = np.random.default_rng(7)
    for mode in ("eager", "graph-cached"):
        rt = runtime(ckpt, mode)
        merged_runs = 0
        for _ in range(6):
            picks = [batches[i] for i in rng.choice(len(batches), size=int(rng.integers(2, 5)), replace=False)]
            g = Group()
            for b in picks:
                if g.admits(b, CAP):
                    g.add(b)
            res = rt.run(g.merged())
            merged_runs += 1
            for b, (logits, act) in zip(g.batches, g.split(res.logits, res.act)):
                alone = rt.run(b)
                assert np.array_equal(logits, alone.logits) and np.array_equal(act, alone.act), mode
        print(f"\nmerged requests byte-identical to alone ({mode}, bf16): {merged_runs} merged runs")


def test_graph_replays_see_new_inputs(ckpt, tiny_ckpt):
    rt = runtime(ckpt, "graph-cached")
    a = Batch.from_rows([(np.arange(5, 60, dtype=np.int32), np.array([1, 7], np.int32), 0)] * 2)
    b = Batch.from_rows([(np.arange(100, 155, dtype=np.int32), np.array([2, 9], np.int32), 1)] * 2)
    assert rt.bucket(a) == rt.bucket(b)
    first, other, again = rt.run(a), rt.run(b), rt.run(a)
    assert other.metrics["graph"] == "hit" and again.metrics["graph"] == "hit"
    assert not np.array_equal(first.logits, other.logits)
    assert np.array_equal(first.logits, again.logits) and np.array_equal(first.act, again.act)


def test_a_landing_is_stamped_when_first_seen_not_when_answered(ckpt, tiny_ckpt):
    """`landed_at` (the replies' stamp, tools/load.py's idle time) is when the host first saw the group done, not
    the later `finish`: a worker answers a landed group only after launching the next one."""
    import time
    rt = runtime(ckpt, "graph-cached")
    batch = frozen_batches(tiny_ckpt)[0]
    job = rt.launch(batch)
    while not job.done():
        pass
    seen = time.monotonic()
    time.sleep(0.05)                    # the next group's forming and launch
    rt.finish(job)
    assert job.landed_at is not None and job.landed_at <= seen, (job.landed_at, seen)


def test_padding_and_bucket_edges(ckpt):
    rt, eager = runtime(ckpt, "graph-cached"), runtime(ckpt, "eager")
    rng = np.random.default_rng(1)

    def rows(n, length, k):
        return [(rng.integers(5, 1000, length).astype(np.int32), np.arange(1, k + 1, dtype=np.int32), i % 3)
                for i in range(n)]
    for n, length, k in ((4, 64, 2), (5, 64, 2), (4, 65, 2), (4, 64, 3), (1, 512, 64), (16, 512, 64)):
        b = Batch.from_rows(rows(n, length, k))
        got, want = rt.run(b), eager.run(b)
        assert got.metrics["graph"] in ("miss", "hit"), got.metrics
        assert np.array_equal(got.logits, want.logits) and np.array_equal(got.act, want.act), (n, length, k)
    assert rt.bucket(Batch.from_rows(rows(5, 65, 3))) == Shape(8, 80, 4)


def test_injected_copy_failure_drains_and_next_request_is_right(ckpt, tiny_ckpt):
    """A group's upload is one copy (worker/workspace.py): when it fails nothing was queued, so nothing drains; a
    failure after some copies of several drains them first (the upload's own rule, on the real cudaMemcpyAsync)."""
    rt = runtime(ckpt, "graph-cached")
    b = frozen_batches(tiny_ckpt)[0]
    want = rt.run(b)
    rt.upload.fault = lambda i: i == 0
    with pytest.raises(UploadError, match="after 0 of 1 copies"):
        rt.run(b)
    assert rt.upload.drains == 0 and rt.upload.last_drained_after == 0
    rt.upload.fault = lambda i: i == 1
    with pytest.raises(UploadError, match="after 1 of 2 copies"):
        rt.upload.submit([(0, 16), (16, 16)], 0)
    assert rt.upload.drains == 1 and rt.upload.last_drained_after == 1
    rt.upload.fault = None
    other = frozen_batches(tiny_ckpt)[3]
    rt.run(other)
    again = rt.run(b)
    assert np.array_equal(again.logits, want.logits) and np.array_equal(again.act, want.act)


def test_eviction_returns_measured_bytes(ckpt):
    rt = runtime(ckpt, "graph-cached", cache_policy=CachePolicy(max_entries=1, max_bytes=1 << 40))
    big = Batch.from_rows([(np.arange(5, 505, dtype=np.int32), np.array([1, 2], np.int32), 0)] * 16)
    small = Batch.from_rows([(np.arange(5, 40, dtype=np.int32), np.array([1, 2], np.int32), 0)])
    rt.run(big)
    held = rt.cache.counters.bytes_held
    assert held > 1 << 20
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    rt.run(small)
    returned = rt.cache.counters.bytes_returned
    print(f"\nevicted graph held {held} B; measured returned {returned} B; reserved {before} -> "
          f"{torch.cuda.memory_reserved()} (+{rt.cache.counters.bytes_held} B for the new entry)")
    assert rt.cache.counters.evictions == 1
    assert abs(returned - held) <= 1 << 20


def test_capture_failure_falls_back_without_leaking(ckpt, tiny_ckpt):
    rt, eager = runtime(ckpt, "graph-cached"), runtime(ckpt, "eager")
    b = frozen_batches(tiny_ckpt)[1]
    gc.collect()                # earlier tests' runtimes, or their frees land inside the measurement
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    rt.capture_fault = lambda: torch.cuda.synchronize()   # not allowed while capturing: a real failure
    got = rt.run(b)
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    assert rt.cache.counters.capture_failures == 1 and got.metrics["graph"] == "fallback"
    assert after - before <= 1 << 20, (before, after)     # a leaked capture pool would stay reserved
    want = eager.run(b)
    assert np.array_equal(got.logits, want.logits)
    rt.capture_fault = None
    assert rt.run(b).metrics["graph"] == "fallback", "a failed bucket stays eager"
    assert rt.run(frozen_batches(tiny_ckpt)[-3]).metrics["graph"] == "miss", "other buckets still capture"


def test_staging_is_pinned_and_steady_state_allocates_nothing(ckpt, tiny_ckpt):
    from cuda.bindings import runtime as cudart
    rt = runtime(ckpt, "graph-cached")
    err, attrs = cudart.cudaPointerGetAttributes(rt.workspace.host_address)
    assert err == cudart.cudaError_t.cudaSuccess and attrs.type == cudart.cudaMemoryType.cudaMemoryTypeHost
    batches = frozen_batches(tiny_ckpt)
    for b in batches:
        rt.run(b)
    addrs = (rt.workspace.host_address, rt.workspace.device_address)
    allocs = torch.cuda.memory_stats()["allocation.all.allocated"]
    for b in batches:
        assert rt.run(b).metrics["graph"] == "hit"
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocs, "a hit must not allocate on the device"
    assert (rt.workspace.host_address, rt.workspace.device_address) == addrs


def _print_key_differences(path: Path) -> None:
    """For kernels compiled both by the parent and by a child (same function, constants, attributes): which parts of
    their on-disk cache keys differ (kernels/compile.py `log_keys`)."""
    if not path.exists():
        return
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    parent = min(r["pid"] for r in rows)    # the parent starts first, so its pid is usually the lowest
    by = {}
    for r in rows:
        by.setdefault((r["fn"], r["constants"], r["attrs"]), {}).setdefault(r["pid"] == parent, r)
    shown = 0
    for (fn, _, _), pair in list(by.items())[:200]:
        if len(pair) == 2:
            diff = {k: (v, pair[False][k]) for k, v in pair[True].items() if k != "pid" and v != pair[False][k]}
            print("key parts differing, parent vs child,", fn, diff)
            shown += 1
            if shown == 4:
                return
    if not shown:
        print("no kernel compiled by both parent and child;", len(rows), "keys logged")


_COMPILE_AHEAD = r"""
import json, os, sys
from pathlib import Path
from laya_pool.kernels.compile import spawn
children = spawn(3) if sys.argv[2] == "early" else None      # (as a worker: before torch is imported here)
from laya_pool.worker.checkpoint import load_checkpoint
from laya_pool.worker.runtime import Runtime, RuntimeConfig
from laya_pool.worker.workspace import Capacity, Shape
cache = Path(os.environ["TRITON_CACHE_DIR"])
shapes = (Shape(4, 128, 4), Shape(1, 64, 2))
rt = Runtime(load_checkpoint(sys.argv[1]), device="cuda", config=RuntimeConfig(
    mode="graph-cached", capacity=Capacity(max_tokens=2048, max_rows=8, max_markers=64, row_markers=8),
    warmup_shapes=shapes, compile_procs=0))
ahead = rt.capturer.compile_ahead([Shape(1, 64, 2), *shapes], 3, children) if sys.argv[2] != "plain" else None
def built():   # kernel binaries and their launchers (C modules Triton compiles on a kernel's first launch)
    return {str(p) for p in cache.rglob("*") if p.suffix in (".cubin", ".so")}
before = built()
rt.warmup()
after = built()
new = sorted(after - before)
print(json.dumps({"ahead": ahead, "compiled_in_warmup": len(new), "new": [p[len(str(cache)) + 1:] for p in new[:12]]}))
"""


def test_kernels_compiled_ahead_leave_nothing_for_the_warm_up_to_compile(tiny_ckpt, tmp_path):
    """A cold Triton cache (a fresh machine): the recorded kernels compiled by three child processes are every
    kernel and launcher the warm-up needs (it builds none); without them it compiles many (the check can fail); a second
    start finds the marker and starts no children."""
    import subprocess
    import sys

    keys = tmp_path / "keys.jsonl"

    def start(cache: Path, how: str) -> dict:
        env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join(sys.path),
                   LAYA_COMPILE_KEYS=str(keys))
        r = subprocess.run([sys.executable, "-c", _COMPILE_AHEAD, str(tiny_ckpt), how], env=env, capture_output=True,
                           text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    ahead = start(tmp_path / "a", "ahead")
    print("compiled ahead:", ahead)
    _print_key_differences(keys)
    assert ahead["ahead"]["failed"] == 0 and ahead["ahead"]["kernels"] >= 8, ahead
    assert ahead["compiled_in_warmup"] == 0, ahead
    plain = start(tmp_path / "b", "plain")
    assert plain["compiled_in_warmup"] >= 8, plain
    again = start(tmp_path / "a", "ahead")
    assert again["ahead"] == {"kernels": ahead["ahead"]["kernels"], "cached": True} and again["compiled_in_warmup"] == 0
    # Children started before the work was known (a worker's first step, kernels/compile.py): the same result.
    early = start(tmp_path / "c", "early")
    print("compiled by children started early:", early)
    assert early["ahead"]["early"] and early["ahead"]["failed"] == 0, early
    assert early["ahead"]["kernels"] == ahead["ahead"]["kernels"] and early["compiled_in_warmup"] == 0, early
    warm = start(tmp_path / "c", "early")        # a warm cache: the early children are let go, none compiles
    assert warm["ahead"] == {"kernels": ahead["ahead"]["kernels"], "cached": True} and warm["compiled_in_warmup"] == 0


def test_a_recording_launches_nothing_not_even_a_kernel_compiled_already(monkeypatch):
    """kernels/compile.py `recorded`: the warm-up's compile-ahead runs forwards whose launches are only recorded. A
    kernel this process had compiled already would run there for real, on buffers that the skipped kernels before
    it never wrote (a RoPE table indexed by garbage positions faults the context). Through
    both of our launch caches (a GEMM's plan; `dispatch`) and Triton's own dispatch (the cache off), nothing may
    change, and only the specialization not compiled yet is recorded."""
    from laya_pool.kernels import cublas
    from laya_pool.kernels.compile import recorded
    from laya_pool.kernels.gemm import gemm
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(48, 64, device="cuda", generator=g).bfloat16()
    w = torch.randn(32, 64, device="cuda", generator=g).bfloat16()
    pos = torch.arange(48, device="cuda", dtype=torch.int32)
    cos, sin = torch.rand(64, 16, device="cuda", generator=g), torch.rand(64, 16, device="cuda", generator=g)
    for cache in ("1", "0"):
        monkeypatch.setenv("LAYA_LAUNCH_CACHE", cache)
        y = torch.randn(48, 64, device="cuda", generator=g).bfloat16()
        gemm(a, w, torch.empty(48, 32, device="cuda", dtype=torch.bfloat16))   # compiled and launched once
        cublas.rotate(y.clone(), pos, cos, sin, 32, 2)
        out, kept = torch.zeros(48, 32, device="cuda", dtype=torch.bfloat16), y.clone()
        with recorded() as specs:
            gemm(a, w, out)
            cublas.rotate(y, pos, cos, sin, 32, 2)
            gemm(a[:17], w, torch.zeros(17, 32, device="cuda", dtype=torch.bfloat16))  # M = 17: not compiled
        torch.cuda.synchronize()
        assert not out.any(), f"LAYA_LAUNCH_CACHE={cache}: a compiled GEMM ran inside the recording"
        assert torch.equal(y, kept), f"LAYA_LAUNCH_CACHE={cache}: a compiled kernel ran inside the recording"
        assert [s.name for s in specs] == ["_gemm_kernel"], [s.name for s in specs]
