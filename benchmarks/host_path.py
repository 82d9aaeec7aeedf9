"""The host's part of a 1x48 decision: the graph replay alone, in-process `predict`, and `predict` through a pool.

    python -m benchmarks.host_path --model /tmp/large [--frontend EP] [--processes 5] [--out DIR]

Each of --processes fresh processes (one after the other, against one pool: started here on --devices unless
--frontend names one) times, at 1x48: the captured graph's own replay and a synchronize (`graph`), `Runtime.run` of
an encoded batch (`replay`: the graph with the slot's pack, copies and readback), in-process `predict` (encode, the
same run, decode) and `Client.predict` through the pool; 30 warm-up calls each, then 4 rounds of 50 calls each, the
order reversed every other round; its medians. A process's medians move with where it lands on the host's CPUs, so
the figures are the medians over the processes: what `predict` costs the host beyond the run (in-process less
replay) and beyond the graph (in-process less graph), and what the pool adds (pooled less in-process).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks.common import add_pool, parser, pool, write

KINDS = ("graph", "replay", "in-process predict", "pool predict")
ROOT = Path(__file__).resolve().parents[1]          # where `python -m benchmarks.host_path` finds it


def measure(model: str, frontend: str) -> dict[str, float]:
    """This process's medians (ms) of the three kinds."""
    import torch

    from laya_pool import Client
    from laya_pool.client.card import ModelCard
    from laya_pool.client.decode import decode_answers
    from laya_pool.client.semantics import encode_request
    from laya_pool.tools.bench import make_request
    from laya_pool.worker.batch import Batch
    from laya_pool.worker.checkpoint import load_checkpoint
    from laya_pool.worker.runtime import Runtime, RuntimeConfig
    from laya_pool.worker.workspace import Capacity
    card = ModelCard.from_dir(model)
    state, questions = make_request(card, 1, 48)
    rt = Runtime(load_checkpoint(model), device="cuda", config=RuntimeConfig(
        mode="graph-cached", capacity=Capacity(max_tokens=16 * 512, max_rows=16, max_markers=1024, row_markers=64)))
    batch = Batch.from_rows(encode_request(card, state, questions).rows)
    client = Client(frontend)

    def in_process() -> None:
        enc = encode_request(card, state, questions)
        r = rt.run(Batch.from_rows(enc.rows))
        decode_answers(card, enc, r.logits, r.act)

    rt.run(batch)
    entry = rt.cache.get(rt.bucket(batch))       # the graph `rt.run(batch)` replays (captured by the run above)
    if entry is None:
        raise SystemExit(f"no graph was captured for {rt.bucket(batch)}: nothing to time as `graph`")
    calls = {"graph": entry.graph.replay, "replay": lambda: rt.run(batch), "in-process predict": in_process,
             "pool predict": lambda: client.predict(state, questions)}
    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    for fn in calls.values():
        for _ in range(30):
            fn()
    for rnd in range(4):
        for k in (KINDS if rnd % 2 == 0 else KINDS[::-1]):
            for _ in range(50):
                torch.cuda.synchronize()
                t = time.perf_counter()
                calls[k]()
                torch.cuda.synchronize()
                samples[k].append((time.perf_counter() - t) * 1e3)
    client.close()
    return {k: round(statistics.median(v), 4) for k, v in samples.items()}


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    med = {k: round(statistics.median(r[k] for r in runs), 4) for k in KINDS}
    return {"processes": runs, "median": med,
            "host (in-process less replay)": round(med["in-process predict"] - med["replay"], 4),
            "host (in-process less graph)": round(med["in-process predict"] - med["graph"], 4),
            "pool adds (pooled less in-process)": round(med["pool predict"] - med["in-process predict"], 4)}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    add_pool(ap)
    ap.add_argument("--processes", type=int, default=5, help="fresh measuring processes")
    ap.add_argument("--in-this-process", action="store_true",
                    help="measure here, print one JSON line (what each fresh process runs)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.in_this_process:
        print(json.dumps(measure(args.model, args.frontend)), flush=True)
        return 0
    runs = []
    with pool(args.model, args.frontend, args.devices) as frontend:
        for i in range(args.processes):
            out = subprocess.run([sys.executable, "-m", "benchmarks.host_path", "--model", args.model, "--frontend",
                                  frontend, "--in-this-process"], check=True, stdout=subprocess.PIPE, text=True,
                                 cwd=ROOT)        # (its stderr is this one's: a failure shows its traceback)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"process {i + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[-1].items()), flush=True)
    result = summary(runs)
    print("1x48 p50 ms, median over the processes: " + ", ".join(f"{k} {v:.3f}" for k, v in result["median"].items())
          + f"; host {result['host (in-process less replay)']:.3f} over the run, "
            f"{result['host (in-process less graph)']:.3f} over the graph, "
            f"pool adds {result['pool adds (pooled less in-process)']:.3f}")
    write(args.out, "host_path", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
