"""The worker's compute thread at saturation, in-process: does the device wait on the host? (issue 12)

    python3 scripts/serving_probe.py --model /tmp/large --device cuda --requests 4000

Builds the runtime as `worker.server` does (graph-cached, the default warm-up plan, misses captured when idle),
prints the warm-up (captures, ms), then for overlap off and on: queues every request at once (1x48 rows, one
four-option question each, as bench.py's), runs the real compute loop (`worker.compute.Compute`: admit, merge up
to --max-batch, launch, answer through the wire codec) until the queue is drained, and reports requests/s, groups,
and the GPU's busy share: the sum of each launched group's graph replay time (each bucket's replay timed alone,
back to back) over the wall time. No sockets: the pool's own overhead is scripts/overhead.py and scripts/load.py.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

# The checkout root, for laya_pool where it is not installed.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from laya_pool.protocol import wire  # noqa: E402
from laya_pool.worker.batch import Batch  # noqa: E402
from laya_pool.worker.checkpoint import load_checkpoint  # noqa: E402
from laya_pool.worker.compute import Compute, Queued  # noqa: E402
from laya_pool.worker.runtime import DEFAULT_MERGED, DEFAULT_WARMUP, Runtime, RuntimeConfig, parse_shapes  # noqa: E402


def requests(n: int, rows: int, tokens: int, markers: int, vocab: int) -> list[Queued]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        b = Batch.from_rows([(rng.integers(5, vocab, tokens).astype(np.int32),
                              np.sort(rng.choice(np.arange(1, tokens), markers, replace=False)).astype(np.int32), 0)
                             for _ in range(rows)])
        arrays = {k: getattr(b, k) for k in wire.REQUEST_ARRAYS}
        out.append(Queued(0, wire.parse_request(wire.decode(wire.encode_request(i, arrays))), time.monotonic()))
    return out


def replay_ms(rt: Runtime, shape, n: int = 50) -> float:
    import torch
    entry = rt.cache.graphs.get(shape)
    if entry is None:
        return float("nan")
    with torch.cuda.stream(rt.stream):
        entry.graph.replay()
        rt.stream.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            entry.graph.replay()
        rt.stream.synchronize()
    return (time.perf_counter() - t) * 1e3 / n


def run(rt: Runtime, items: list[Queued], max_group: int) -> dict:
    shapes: list = []
    launch = rt.launch

    def recording(*a, **kw):
        job = launch(*a, **kw)
        shapes.append(job.shape)
        return job
    rt.launch = recording
    replies: list = []
    counts = Counter()
    c = Compute(rt, "probe", rt.fingerprint, max_group, lambda frames, to=None: replies.append(frames), counts)
    for q in items:
        c.inbox.put(q)
    c.inbox.put(None)
    t = time.perf_counter()
    c.loop()
    wall = time.perf_counter() - t
    rt.launch = launch
    return {"wall_s": wall, "replies": len(replies), "ok": counts["ok"], "groups": len(shapes),
            "shapes": Counter(shapes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--markers", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=32)
    args = ap.parse_args()
    t = time.perf_counter()
    ck = load_checkpoint(args.model)
    print(f"checkpoint {time.perf_counter() - t:.2f} s")
    items = requests(args.requests, args.rows, args.tokens, args.markers, ck.arch.vocab_size)
    for overlap in (False, True):
        mode = "graph-cached" if args.device.startswith("cuda") else "eager"     # a CPU run is a smoke test
        cfg = RuntimeConfig(mode=mode, capture="idle", overlap=overlap,
                            warmup_shapes=parse_shapes(DEFAULT_WARMUP), warmup_merged=parse_shapes(DEFAULT_MERGED),
                            warmup_group=args.max_batch)
        t = time.perf_counter()
        rt = Runtime(ck, device=args.device, config=cfg)
        steps = rt.warmup()
        step_ms = sum(v for v in steps.values() if isinstance(v, float))     # ("compile" holds a dict)
        print(f"overlap {'on' if overlap else 'off'}: runtime + warm-up {time.perf_counter() - t:.2f} s, "
              f"{rt.cache.counters.captures} buckets captured ({step_ms:.0f} ms in warm-up steps)")
        run(rt, items[: min(200, len(items))], args.max_batch)           # untimed: first replays, allocator
        r = run(rt, items, args.max_batch)
        busy_ms = sum(n * replay_ms(rt, shape) for shape, n in r["shapes"].items()) if rt.is_cuda else float("nan")
        c = rt.cache.counters
        print(f"  {r['ok']}/{len(items)} answered in {r['wall_s']:.3f} s: {r['ok'] / r['wall_s']:.0f} req/s, "
              f"{r['groups']} groups (mean {r['ok'] / max(1, r['groups']):.1f}), "
              f"GPU busy ~{busy_ms / 1e3 / r['wall_s']:.1%} "
              f"(sum of replay times {busy_ms:.0f} ms); request-path captures {c.request_path_captures}, "
              f"misses {c.misses}, covered {c.covered}")
        print(f"  buckets: {dict((str(tuple(vars(s).values())), n) for s, n in r['shapes'].most_common(6))}")
        rt.close()


if __name__ == "__main__":
    main()
