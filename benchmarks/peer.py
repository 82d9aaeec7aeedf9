"""Same run, same checkpoint, same requests: laya-pool against laya-cuda (the peer runtime) and the official SDK.

    python -m benchmarks.peer --model /tmp/large [--frontend EP] [--shapes 1x48,1x128,4x256,16x512]
                              [--sdk-backends eager,compile] [--out DIR]

In one process, per request shape (`laya_pool.tools.bench.make_request`: one state of R rows of N tokens): our
in-process graph-cached `predict` (encode, `Runtime.run`, decode), `Client.predict` through a pool (started here on
--devices unless --frontend names one), laya-cuda's `Engine.predict` (`pip install laya-cuda`; skipped when absent)
and the SDK's `Agent.predict` for each --sdk-backends. Two rounds, the configurations in opposite order; in each, 10
warm-up calls and 40 timed ones per shape and configuration, host clock with a CUDA synchronize on both sides. Prints
p50 / p95 ms and laya-cuda's p50 over each configuration's (above 1: faster than laya-cuda).
"""
from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from benchmarks.common import add_pool, parser, percentiles, pool, write

WARMUP, SAMPLES, ROUNDS = 10, 40, 2
PEER = "laya-cuda predict"


def shapes(text: str) -> list[tuple[int, int]]:
    return [(int(r), int(n)) for r, n in (s.split("x") for s in text.split(","))]


def in_process(model: str, card: Any, max_rows: int) -> Callable[[Any, Any], Any]:
    """Our predict without the pool: the worker's runtime (graph-cached) in this process."""
    from laya_pool.client.decode import decode_answers
    from laya_pool.client.semantics import encode_request
    from laya_pool.worker.batch import Batch
    from laya_pool.worker.checkpoint import load_checkpoint
    from laya_pool.worker.runtime import Runtime, RuntimeConfig
    from laya_pool.worker.workspace import Capacity
    rt = Runtime(load_checkpoint(model), device="cuda", config=RuntimeConfig(
        mode="graph-cached", capacity=Capacity(max_tokens=max_rows * 512, max_rows=max_rows, max_markers=1024,
                                               row_markers=64)))

    def predict(state: Any, questions: Any) -> Any:
        enc = encode_request(card, state, questions)
        r = rt.run(Batch.from_rows(enc.rows))
        return decode_answers(card, enc, r.logits, r.act)
    return predict


def sdk(model: str, backend: str, requests: list) -> Callable[[Any, Any], Any]:
    """The SDK's predict on `backend`, its own warm-up (or compile) per shape done here."""
    import laya
    t0 = time.perf_counter()
    agent = laya.load(model, device="cuda")
    if backend != "eager":
        agent.set_backend(backend, strict=True)
    for state, questions in requests:
        agent.predict(state, questions)
        agent.predict(state, questions)
    print(f"sdk backend {backend} ready in {time.perf_counter() - t0:.1f} s (active: {agent.backend})", flush=True)
    return agent.predict


def configurations(args: Any, card: Any, requests: list, frontend: str,
                   stack: contextlib.ExitStack) -> dict[str, Callable[[Any, Any], Any]]:
    from laya_pool import Client
    max_rows = max(16, *(r for r, _ in shapes(args.shapes)))
    out: dict[str, Callable[[Any, Any], Any]] = {"ours predict (in-process)": in_process(args.model, card, max_rows)}
    out["ours pool Client.predict"] = stack.enter_context(Client(frontend)).predict
    try:
        from laya_cuda import Engine
        out[PEER] = stack.enter_context(Engine(args.model)).predict
    except ImportError:
        print("laya-cuda is not installed (pip install laya-cuda): its row is skipped", flush=True)
    for backend in args.sdk_backends.split(","):
        try:
            out[f"sdk predict ({backend})"] = sdk(args.model, backend, requests)
        except Exception as e:  # noqa: BLE001 - a backend this host cannot run is reported, the others measured
            print(f"sdk backend {backend} failed: {e!r}"[:400], flush=True)
    return out


def measure(calls: dict[str, Callable[[Any, Any], Any]], requests: list, names: list[str]) -> dict[str, dict]:
    """ms samples per configuration and shape, rounds alternating the configurations' order."""
    import torch
    for c in list(calls):                       # first calls (captures, compiles) are not measured
        try:
            for request in requests:
                calls[c](*request)
                calls[c](*request)
        except Exception as e:  # noqa: BLE001 - a configuration that cannot run a shape is left out, and said
            print(f"{c} infeasible: {e!r}"[:300], flush=True)
            del calls[c]
    samples: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in calls}
    for rnd in range(ROUNDS):
        for name, request in zip(names, requests):
            for c in (list(calls) if rnd % 2 == 0 else list(calls)[::-1]):
                for _ in range(WARMUP):
                    calls[c](*request)
                for _ in range(SAMPLES):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    calls[c](*request)
                    torch.cuda.synchronize()
                    samples[c][name].append((time.perf_counter() - t) * 1e3)
    return {c: {n: percentiles(v) for n, v in per.items()} for c, per in samples.items()}


def report(ms: dict[str, dict], names: list[str]) -> dict[str, dict[str, float]]:
    print(f"{'p50 / p95 ms':28s}" + "".join(f"{n:>18s}" for n in names))
    for c, per in ms.items():
        print(f"{c:28s}" + "".join(f"{per[n]['p50']:>10.3f} /{per[n]['p95']:>6.3f}" for n in names))
    ratios: dict[str, dict[str, float]] = {}
    if PEER in ms:
        for c, per in ms.items():
            ratios[c] = {n: round(ms[PEER][n]["p50"] / per[n]["p50"], 2) for n in names}
            print(f"laya-cuda p50 / {c}: {ratios[c]}")
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    add_pool(ap)
    ap.add_argument("--shapes", default="1x48,1x128,4x256,16x512", help="RxN request shapes")
    ap.add_argument("--sdk-backends", default="eager", help="the SDK's backends to run (eager, compile)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    from laya_pool.client.card import ModelCard
    from laya_pool.tools.bench import make_request
    card = ModelCard.from_dir(args.model)
    names = [f"{r}x{n}" for r, n in shapes(args.shapes)]
    requests = [make_request(card, r, n) for r, n in shapes(args.shapes)]
    with pool(args.model, args.frontend, args.devices) as frontend, contextlib.ExitStack() as stack:
        ms = measure(configurations(args, card, requests, frontend, stack), requests, names)
    ratios = report(ms, names)
    write(args.out, "peer", {"ms": ms, "laya_cuda_over": ratios, "shapes": names})
    return 0


if __name__ == "__main__":
    sys.exit(main())
