"""What a wait does to the host work after it: a 1x48 request's encode and decode, back to back and after ~1 ms waits.

    python -m benchmarks.after_wait --model DIR [--device cuda|cpu] [--calls 150] [--rounds 6] [--out DIR]

A decision loop's host work runs between waits: in-process after the forward's replay and synchronize, through a pool
after the call's wait. Each kind is a wait, then one timed `encode_request` and one timed `decode_answers` of the
same 1x48 request; --rounds rounds of --calls each kind, the kinds' order reversed every other round, the first round
warm-up. Kinds: `none` (back to back), `sleep` (time.sleep, 1 ms), `spin` (a Python loop, 1 ms); on CUDA also
`synchronize` (the request's captured graph replayed, torch.cuda.synchronize), `query loop` (replayed, a CUDA event
asked until done: the thread never sleeps) and `Runtime.run` (the run an in-process `predict` makes between them).
Prints each kind's encode and decode p50 / p95 (us). docs/decisions/0030-host-work-after-a-wait.md.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import parser, percentiles, write

WAIT_S = 1e-3                 # about a 1x48 forward's device time on an H100


def spin(seconds: float) -> None:
    """Run Python for `seconds` without sleeping."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def cuda_waits(model: str, batch: Any) -> dict[str, Callable[[], Any]]:
    """The waits a CUDA host adds: the request's graph replayed and waited for two ways, and a whole `Runtime.run`."""
    import torch

    from laya_pool.worker.checkpoint import load_checkpoint
    from laya_pool.worker.runtime import Runtime, RuntimeConfig
    rt = Runtime(load_checkpoint(model), device="cuda", config=RuntimeConfig(mode="graph-cached"))
    rt.run(batch)                                   # captures the request's bucket
    entry = rt.cache.get(rt.bucket(batch))
    if entry is None:
        raise SystemExit(f"no graph was captured for {rt.bucket(batch)}: nothing to replay")
    graph = entry.graph
    done = torch.cuda.Event()

    def synchronize() -> None:
        graph.replay()
        torch.cuda.synchronize()

    def query_loop() -> None:
        graph.replay()
        done.record()
        while not done.query():
            pass
    return {"synchronize": synchronize, "query loop": query_loop, "Runtime.run": lambda: rt.run(batch)}


def measure(waits: dict[str, Callable[[], Any]], encode: Callable[[], Any], decode: Callable[[Any], Any],
            calls: int, rounds: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per kind, the encode and decode that follow its wait: p50 and p95 in us."""
    samples: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in waits}
    for rnd in range(rounds):
        order = list(waits) if rnd % 2 == 0 else list(waits)[::-1]
        for kind in order:
            for _ in range(calls):
                waits[kind]()
                t0 = time.perf_counter()
                enc = encode()
                t1 = time.perf_counter()
                decode(enc)
                t2 = time.perf_counter()
                if rnd:                             # the first round warms up
                    samples[kind][0].append((t1 - t0) * 1e6)
                    samples[kind][1].append((t2 - t1) * 1e6)
    return {kind: {"encode": percentiles(enc), "decode": percentiles(dec)} for kind, (enc, dec) in samples.items()}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: only none, sleep and spin")
    ap.add_argument("--calls", type=int, default=150, help="calls of each kind a round")
    ap.add_argument("--rounds", type=int, default=6, help="rounds, the first one warm-up")
    args = ap.parse_args(argv)
    if args.rounds < 2 or args.calls < 1:
        ap.error("--rounds must be at least 2 (the first warms up) and --calls at least 1")
    import numpy as np

    from laya_pool.client.card import ModelCard
    from laya_pool.client.decode import decode_answers
    from laya_pool.client.semantics import encode_request
    from laya_pool.tools.bench import make_request
    from laya_pool.worker.batch import Batch
    card = ModelCard.from_dir(args.model)
    state, questions = make_request(card, 1, 48)
    first = encode_request(card, state, questions)
    logits, act = np.zeros(first.n_markers, np.float32), np.zeros((len(first.rows), card.n_act), np.float32)
    waits: dict[str, Callable[[], Any]] = {"none": lambda: None, "sleep": lambda: time.sleep(WAIT_S),
                                           "spin": lambda: spin(WAIT_S)}
    if args.device == "cuda":
        waits.update(cuda_waits(args.model, Batch.from_rows(first.rows)))
    result = measure(waits, lambda: encode_request(card, state, questions),
                     lambda enc: decode_answers(card, enc, logits, act), args.calls, args.rounds)
    print(f"1x48, us after each kind of wait ({args.rounds - 1} rounds of {args.calls}):")
    print(f"{'after':14s} {'encode p50 / p95':>18s} {'decode p50 / p95':>18s}")
    for kind, r in result.items():
        print(f"{kind:14s} {r['encode']['p50']:>9.1f} / {r['encode']['p95']:<6.1f} "
              f"{r['decode']['p50']:>9.1f} / {r['decode']['p95']:<6.1f}")
    write(args.out, "after_wait", {"device": args.device, "wait_ms": WAIT_S * 1e3, "kinds": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
