#!/usr/bin/env python3
"""Graph-cache policies on a real GPU: six policies x 48 requests, checked against an independent model.

    laya-pool check-cache-gpu [--model DIR] [--report FILE]

Every bucket's graph size is measured first (reserved-memory growth across its capture, cross-checked
against the allocator's own segment list for the graph's pool). Then each policy runs the same 48
requests; the expected survivors (in LRU order), hits and fallbacks come from a simple list model
written here, not from the cache code. Bytes returned on eviction are measured. Also checks that a
failed capture falls back and frees its pool, and that a graph's buffers outlive every replay.
Exits 1 on any violation.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

MiB = 1 << 20
ROW_SHAPES = [(1, 40, 2), (2, 100, 3), (4, 200, 4), (8, 300, 6), (16, 500, 8), (3, 60, 9)]


def batch_for(kind: int, seed: int):
    from laya_pool.worker.batch import Batch
    rows, length, k = ROW_SHAPES[kind]
    rng = np.random.default_rng(seed)
    return Batch.from_rows([(rng.integers(5, 1000, length).astype(np.int32),
                             np.sort(rng.choice(np.arange(1, length), k, replace=False)).astype(np.int32),
                             int(rng.integers(0, 3))) for _ in range(rows)])


def simulate(max_entries: int, max_bytes: int, sizes: dict, stream: list) -> dict:
    held, hits, fallbacks, evicted, never = [], 0, 0, [], set()
    for key in stream:
        if key in held:
            hits += 1
            held.remove(key)
            held.append(key)
        elif max_entries <= 0 or max_bytes <= 0 or key in never or sizes[key] > max_bytes:
            fallbacks += 1
            never.add(key)
        else:
            while held and (sum(sizes[k] for k in held) + sizes[key] > max_bytes or len(held) + 1 > max_entries):
                evicted.append(held.pop(0))
            held.append(key)
    return {"survivors": held, "hits": hits, "fallbacks": fallbacks, "evicted": evicted}


def pool_segment_bytes(pool) -> int:
    import torch
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--report", default="out/check_cache_gpu.json")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("check_cache_gpu: no CUDA device")
        return 2
    from laya_pool.worker.checkpoint import load_checkpoint
    from laya_pool.worker.runtime import Runtime, RuntimeConfig
    from laya_pool.worker.workspace import Capacity

    model = args.model
    if model is None:
        from .make_checkpoint import make_checkpoint
        model = make_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "tiny", 0)
    ck = load_checkpoint(model)
    cap = Capacity(max_tokens=16 * 512, max_rows=16, max_markers=1024, row_markers=16)
    violations: list[str] = []

    eager = Runtime(ck, device="cuda", config=RuntimeConfig(mode="eager", capacity=cap))
    keys, sizes = _bucket_sizes(ck, cap, violations)
    print("bucket sizes:", {str(k): v for k, v in sizes.items()})
    rows = _check_policies(ck, cap, eager, keys, sizes, violations)
    failure_ok, leaked = _check_capture_failure(ck, cap, eager, violations)
    lifetime_ok = _check_lifetime(ck, cap, violations)

    print(f"{'policy':20} {'entries':>7} {'budget':>12} {'hits':>5} {'fallbk':>6} {'evict':>5} "
          f"{'returned B':>11} {'survivors'}")
    for r in rows:
        print(f"{r['policy']:20} {r['max_entries']:7} {r['max_bytes']:12} {r['hits']:5} {r['fallbacks']:6} "
              f"{r['evictions']:5} {r['bytes_returned']:11} {[tuple(vars(k).values()) for k in r['survivors']]}")
    print(f"capture failure falls back and frees its pool: {failure_ok} (leak {leaked} B)")
    print(f"graph buffers outlive every replay: {lifetime_ok}")
    report = {"sizes": {str(k): v for k, v in sizes.items()}, "policies": [
        {**r, "survivors": [str(k) for k in r["survivors"]]} for r in rows],
        "capture_failure_ok": failure_ok, "lifetime_ok": lifetime_ok, "violations": violations}
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text(json.dumps(report, indent=2))
    for v in violations:
        print("VIOLATION:", v)
    print("check_cache_gpu:", "OK" if not violations else f"{len(violations)} violations")
    return 1 if violations else 0


def _graph_runtime(ck, cap, policy):
    """A graph-cached runtime on the GPU with `policy`."""
    from laya_pool.worker.runtime import Runtime, RuntimeConfig
    return Runtime(ck, device="cuda", config=RuntimeConfig(mode="graph-cached", capacity=cap, cache_policy=policy))


def _collect() -> None:
    """Give a closed (and dropped) runtime's memory back, so the next runtime's measurements start clean."""
    import torch
    gc.collect()
    torch.cuda.empty_cache()


def _bucket_sizes(ck, cap, violations: list[str]) -> tuple[list, dict]:
    """Every row shape's bucket and its graph's size, measured and cross-checked with the pool's segments."""
    from laya_pool.worker.graphs import CachePolicy
    probe = _graph_runtime(ck, cap, CachePolicy(64, 1 << 40))
    keys, sizes = [], {}
    for kind in range(len(ROW_SHAPES)):
        b = batch_for(kind, 0)
        key = probe.bucket(b)
        probe.run(b)
        entry = probe.cache.graphs[key]
        keys.append(key)
        sizes[key] = entry.nbytes
        seg = pool_segment_bytes(tuple(entry.pool))
        if abs(seg - entry.nbytes) > MiB:
            violations.append(f"{key}: measured {entry.nbytes} B but the pool's segments hold {seg} B")
    probe.close()
    del probe
    _collect()
    return keys, sizes


def _check_policies(ck, cap, eager, keys: list, sizes: dict, violations: list[str]) -> list[dict]:
    """Each policy over the same 48 requests against the list model (`simulate`) and eager answers."""
    from laya_pool.worker.graphs import CachePolicy
    order = np.random.default_rng(7).integers(0, len(ROW_SHAPES), 48).tolist()
    stream = [keys[i] for i in order]
    by_size = sorted(sizes.values())
    policies = {
        "count eviction": (2, 1 << 40),
        "byte eviction": (64, by_size[-1] + by_size[-2] - 1),
        "surviving entries": (3, 1 << 40),
        "exact budget": (64, sizes[keys[3]]),
        "oversized fallback": (64, by_size[0] - 1),
        "caching disabled": (64, 0),
    }
    rows = []
    for name, (entries, budget) in policies.items():
        want = simulate(entries, budget, sizes, stream)
        rt = _graph_runtime(ck, cap, CachePolicy(entries, budget))
        mismatched = 0
        for seed, kind in enumerate(order):
            b = batch_for(kind, seed)
            got, ref = rt.run(b), eager.run(b)
            if not (np.array_equal(got.logits, ref.logits) and np.array_equal(got.act, ref.act)):
                mismatched += 1
            if rt.cache.counters.bytes_held > budget:
                violations.append(f"{name}: holds {rt.cache.counters.bytes_held} B over the budget {budget}")
        rows.append(_policy_row(name, entries, budget, rt.cache, want, sizes, stream, keys, mismatched, violations))
        rt.close()
        del rt
        _collect()
    return rows


def _policy_row(name: str, entries: int, budget: int, cache, want: dict, sizes: dict, stream: list, keys: list,
                mismatched: int, violations: list[str]) -> dict:
    """One policy's outcome against the list model's, its violations noted."""
    c = cache.counters
    evicted_bytes = sum(sizes[k] for k in want["evicted"])
    got_state = {"survivors": cache.keys(), "hits": c.hits, "fallbacks": c.fallbacks, "evictions": c.evictions}
    for field in ("survivors", "hits", "fallbacks"):
        if got_state[field] != want[field]:
            violations.append(f"{name}: {field} {got_state[field]} != expected {want[field]}")
    if c.evictions != len(want["evicted"]):
        violations.append(f"{name}: {c.evictions} evictions, expected {len(want['evicted'])}")
    if abs(c.bytes_returned - evicted_bytes) > MiB * max(1, c.evictions):
        violations.append(f"{name}: eviction returned {c.bytes_returned} B, evicted graphs held {evicted_bytes}")
    if mismatched:
        violations.append(f"{name}: {mismatched} of 48 answers differ from eager")
    if name == "exact budget" and (keys[3] in cache.uncacheable or c.oversized != sum(
            1 for k in set(stream) if sizes[k] > budget)):
        # It may be evicted later by LRU; what matters is that it was admitted, not refused as oversized.
        violations.append("exact budget: the entry exactly at the budget was refused as oversized")
    return {"policy": name, "max_entries": entries, "max_bytes": budget, **got_state,
            "expected_survivors": len(want["survivors"]), "bytes_returned": c.bytes_returned,
            "evicted_bytes_expected": evicted_bytes, "captures": c.captures, "oversized": c.oversized,
            "mismatched": mismatched}


def _check_capture_failure(ck, cap, eager, violations: list[str]) -> tuple[bool, int]:
    """A failed capture falls back and frees its pool: (ok, bytes leaked)."""
    import torch

    from laya_pool.worker.graphs import CachePolicy
    rt = _graph_runtime(ck, cap, CachePolicy(64, 1 << 40))
    b = batch_for(2, 0)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    rt.capture_fault = torch.cuda.synchronize
    got = rt.run(b)
    torch.cuda.empty_cache()
    leaked = torch.cuda.memory_reserved() - before
    failure_ok = (got.metrics["graph"] == "fallback" and rt.cache.counters.capture_failures == 1
                  and abs(leaked) <= MiB and np.array_equal(got.logits, eager.run(b).logits))
    if not failure_ok:
        violations.append(f"capture failure: graph={got.metrics['graph']} leaked={leaked} B")
    rt.close()
    return failure_ok, leaked


def _check_lifetime(ck, cap, violations: list[str]) -> bool:
    """One graph's buffers stay put and keep answering through replays, captures and evictions."""
    import torch

    from laya_pool.worker.graphs import CachePolicy
    rt = _graph_runtime(ck, cap, CachePolicy(2, 1 << 40))
    first = batch_for(0, 0)
    want_first = rt.run(first)
    entry = rt.cache.graphs[rt.bucket(first)]
    ptrs = [t.data_ptr() for t in entry.outputs]
    for i in range(30):
        rt.run(batch_for(0, 100 + i))
        if i % 10 == 0:
            gc.collect()
            torch.cuda.empty_cache()
    again = rt.run(first)
    lifetime_ok = ([t.data_ptr() for t in entry.outputs] == ptrs and np.array_equal(again.logits, want_first.logits)
                   and entry.replays >= 31)
    if not lifetime_ok:
        violations.append("lifetime: graph outputs moved or replays gave a different answer")
    rt.close()
    return lifetime_ok


if __name__ == "__main__":
    sys.exit(main())
