#!/usr/bin/env python3
"""Device probe: where an in-process `predict` goes (encode, `Runtime.run`'s own split, decode) against the graph replay
alone (CUDA events), at 1x48, 4x256 and 16x512, graph-cached, p50 ms.

    python3 scripts/host_split.py MODEL
"""
import os
import statistics
import sys
import time

# The checkout root, for laya_pool where it is not installed.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from laya_pool.client.card import ModelCard  # noqa: E402
from laya_pool.client.decode import decode_answers  # noqa: E402
from laya_pool.client.semantics import encode_request  # noqa: E402
from laya_pool.tools.bench import make_request  # noqa: E402
from laya_pool.worker.batch import Batch  # noqa: E402
from laya_pool.worker.checkpoint import load_checkpoint  # noqa: E402
from laya_pool.worker.runtime import Runtime, RuntimeConfig  # noqa: E402
from laya_pool.worker.workspace import Capacity  # noqa: E402

KEYS = ("encode", "batch", "run", "decode", "total")
STEPS = ("validate_ms", "plan_ms", "pack_ms", "device_ms")


def predict_split(rt: Runtime, card: ModelCard, state, questions, calls: int = 250, skip: int = 50) -> dict:
    t: dict[str, list[float]] = {k: [] for k in KEYS + STEPS}
    for i in range(calls):
        a = time.perf_counter()
        enc = encode_request(card, state, questions)
        b = time.perf_counter()
        batch = Batch.from_rows(enc.rows)
        c = time.perf_counter()
        r = rt.run(batch)
        d = time.perf_counter()
        decode_answers(card, enc, r.logits, r.act)
        e = time.perf_counter()
        if i >= skip:
            for k, v in zip(KEYS, (b - a, c - b, d - c, e - d, e - a)):
                t[k].append(v * 1e3)
            for k in STEPS:
                t[k].append(r.metrics[k])
    out = {k: statistics.median(v) for k, v in t.items()}
    out["replay alone"] = replay_alone(rt, rt.bucket(batch))
    return out


def replay_alone(rt: Runtime, shape, samples: int = 200) -> float:
    entry = rt.cache.lookup(shape, count=False)
    ts = []
    for _ in range(samples):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(rt.stream):
            e0.record()
            entry.graph.replay()
            e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    return statistics.median(ts[samples // 4:])


def main() -> None:
    model = sys.argv[1]
    card = ModelCard.from_dir(model)
    rt = Runtime(load_checkpoint(model), device="cuda", config=RuntimeConfig(
        mode="graph-cached", capacity=Capacity(max_tokens=16 * 512, max_rows=16, max_markers=1024, row_markers=64)))
    rt.warmup()
    print("forward:", rt.forward_name)
    for rows, length in ((1, 48), (4, 256), (16, 512)):
        split = predict_split(rt, card, *make_request(card, rows, length))
        print(f"{rows}x{length}: " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))


if __name__ == "__main__":
    main()
