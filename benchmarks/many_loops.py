"""Many decision loops on one GPU: each process with its own laya-cuda engine, against each with a client of one pool.

    python -m benchmarks.many_loops --model /tmp/large [--frontend EP] [--loops 8] [--seconds 8] [--out DIR]

--loops processes each call `predict` at 1x48 (`laya_pool.tools.bench.make_request`) in a closed loop for --seconds,
all starting together once every one has warmed up (20 calls): first each with a `Client` to one pool (started here
on --devices unless --frontend names one), then each with its own laya-cuda `Engine` (what a user runs without a
pool; `pip install laya-cuda`, skipped when absent). Prints the aggregate decisions per second and the p50 / p95 of
every call.
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
import warnings
from typing import Any

from benchmarks.common import add_pool, parser, pool, write


def loop(kind: str, model: str, frontend: str, seconds: float, ready: Any, start: Any, results: Any) -> None:
    """One decision loop: warm up, say so, wait for the start, call until the time is up; its latencies (ms)."""
    warnings.simplefilter("ignore")
    from laya_pool.client.card import ModelCard
    from laya_pool.tools.bench import make_request
    card = ModelCard.from_dir(model)
    state, questions = make_request(card, 1, 48)
    if kind == "laya-cuda":
        from laya_cuda import Engine
        engine = Engine(model).__enter__()
        def call() -> Any:
            return engine.predict(state, questions)
    else:
        from laya_pool import Client
        client = Client(frontend)
        def call() -> Any:
            return client.predict(state, questions)
    for _ in range(20):
        call()
    ready.put(1)
    start.wait()
    lat, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        call()
        lat.append((time.perf_counter() - t) * 1e3)
    results.put(lat)


def run(kind: str, model: str, frontend: str, loops: int, seconds: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, results, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=loop, args=(kind, model, frontend, seconds, ready, start, results))
             for _ in range(loops)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=300)          # every loop loaded and warm (laya-cuda engines load one model each)
        start.set()
        lats = [results.get(timeout=seconds + 120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    every = sorted(x for lat in lats for x in lat)
    return {"loops": loops, "decisions_per_s": round(len(every) / seconds, 1),
            "p50_ms": round(statistics.median(every), 4), "p95_ms": round(every[int(0.95 * (len(every) - 1))], 4)}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    add_pool(ap)
    ap.add_argument("--loops", type=int, default=8, help="decision-loop processes")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long every loop calls")
    args = ap.parse_args(argv)
    import importlib.util
    kinds = ["pool"] + (["laya-cuda"] if importlib.util.find_spec("laya_cuda") else [])
    if len(kinds) == 1:
        print("laya-cuda is not installed (pip install laya-cuda): its row is skipped", flush=True)
    out: dict[str, Any] = {}
    with pool(args.model, args.frontend, args.devices) as frontend:
        for kind in kinds:
            out[kind] = run(kind, args.model, frontend, args.loops, args.seconds)
            r = out[kind]
            print(f"{kind:10s} {args.loops} loops: {r['decisions_per_s']:.0f} decisions/s, p50 {r['p50_ms']:.2f} ms, "
                  f"p95 {r['p95_ms']:.2f} ms", flush=True)
    write(args.out, f"many_loops_{args.loops}", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
