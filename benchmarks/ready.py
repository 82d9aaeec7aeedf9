"""How long `laya-pool up` takes to a ready pool: the process started to every worker READY in `status`.

    python -m benchmarks.ready --model /tmp/large [--devices cuda:0] [--runs 3] [--warm-cache] [--out DIR]

Each run starts a pool (`laya-pool up --model ... --devices ...`, a tcp frontend on loopback), polls its status
every 0.2 s until every worker is ready, and stops it. By default every run gets an empty Triton cache of its own
(TRITON_CACHE_DIR in a fresh temporary directory): a first start on a host, every kernel compiled. `--warm-cache`:
the runs share one cache, so the first is cold and the others find their kernels compiled (a restart). Prints each
run's seconds and the lines of the pool's log on its workers' warm-up and start.
"""
from __future__ import annotations

import re
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import free_endpoint, parser, write


def start_once(model: str, devices: str, cache: str, extra: list[str]) -> dict[str, Any]:
    """One `up` to ready: seconds, and the lines of the pool's log on its workers' start."""
    from laya_pool import local_pool
    t0 = time.monotonic()
    with local_pool(model, devices, frontend=free_endpoint(), extra_args=extra,
                    env={"TRITON_CACHE_DIR": cache}) as p:
        seconds = time.monotonic() - t0
        workers = len(p.status()["workers"])
        log = [ln for ln in p.log().splitlines() if re.search(r"warm-up \d|started in|pool ready", ln)]
    return {"seconds": round(seconds, 2), "workers": workers, "log": log}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--devices", default="cuda:0", help="the pool's devices")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warm-cache", action="store_true", help="one Triton cache for every run (the first is cold)")
    ap.add_argument("--pool-args", default="", help="extra `laya-pool up` arguments")
    args = ap.parse_args(argv)
    import shlex
    runs = []
    with tempfile.TemporaryDirectory(prefix="laya-ready-") as tmp:
        for i in range(args.runs):
            cache = f"{tmp}/triton" if args.warm_cache else f"{tmp}/triton-{i}"
            runs.append(start_once(args.model, args.devices, cache, shlex.split(args.pool_args)))
            print(f"run {i + 1}: ready {runs[-1]['seconds']:.1f} s after `up` "
                  f"({'cold' if i == 0 or not args.warm_cache else 'warm'} Triton cache, "
                  f"{runs[-1]['workers']} workers; +- 0.2 s, the status poll)", flush=True)
            for line in runs[-1]["log"]:
                print(f"   {line}")
    write(args.out, "ready", {"devices": args.devices, "warm_cache": args.warm_cache, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
