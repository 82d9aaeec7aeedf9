"""The client's own CPU cost per `predict`, by stage, for bench.py's request shapes (no pool needed).

    python -m benchmarks.client_speed --model DIR [--calls 400] [--stub] [--out DIR]

Stages: `encode` (questions checked, state tokenized as far as the rows keep it, rows built: what runs
before the request is sent), `encode whole` (the same with the whole state tokenized, the cost a
window saves), `pack` (rows into the wire's five arrays), `count` (the whole state's token count, which runs
in a background thread while the pool computes; timed here on its own), `decode` (logits into the SDK's
answer dicts, the count already there). Medians and p95 in ms after a warm-up; the background count of
each encode is waited for outside the timed region so it never overlaps the next timed call.

`--stub`: also the calls through a pool whose worker answers at once (a broker and laya_pool/tools/stub_worker.py
serving this checkpoint's card, the client on the worker's direct socket), 1x48: `Client.predict`, `Client.forward`
of the same rows, `ping`, in-process encode + decode, and `AsyncClient.predict` (timed inside one event loop), rounds
alternating. Predict less forward less encode + decode is what the predict path adds on the host beyond the stages
above; `AsyncClient.predict` less `Client.predict` is what asyncio adds (the HTTP gateway's client). And the client's
own work alone, with no wire and no other process: `predict, reply replayed` (`Client.predict` whose pool call is
answered at once with a reply recorded from the stub: everything the client runs but the socket or lane and the
wait) against `encode + wire + decode` (encode_request, the request's frames, the reply parsed, decode_answers:
the stages it cannot skip); their difference is the call's own Python (its plan, checks and bookkeeping).
"""
from __future__ import annotations

import asyncio
import functools
import sys
import time
from collections.abc import Callable

import numpy as np

from benchmarks.common import parser, percentiles, write
from laya_pool.client.card import ModelCard
from laya_pool.client.decode import decode_answers
from laya_pool.client.semantics import encode_request, serialize_state
from laya_pool.protocol import wire
from laya_pool.tools.bench import SHAPES, make_request


def timed(fn: Callable[[], object], calls: int, after: Callable[[object], object] = lambda r: None) -> dict:
    xs = []
    for i in range(calls + calls // 4):
        t = time.perf_counter()
        r = fn()
        dt = time.perf_counter() - t
        after(r)                                  # outside the clock
        if i >= calls // 4:                       # the first quarter is warm-up
            xs.append(dt * 1e3)
    return percentiles(xs)


def measure(card: ModelCard, rows: int, length: int, calls: int) -> dict:
    state, questions = make_request(card, rows, length)
    enc = encode_request(card, state, questions)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(enc.n_markers).astype(np.float32)
    act = rng.random((len(enc.rows), card.n_act)).astype(np.float32)
    text = serialize_state(state)
    return {
        "shape": f"{rows}x{length}",
        "state_tokens": enc.state_stats[0]["state_tokens"],
        "window_tokens": len(enc.state.ids),
        "encode": timed(lambda: encode_request(card, state, questions), calls, lambda e: e.state.count()),
        "encode whole": timed(lambda: encode_request(card, state, questions, window=False), calls),
        "pack": timed(lambda: wire.pack_rows(enc.rows), calls),
        "count": timed(lambda: card.encode(text), calls),
        "decode": timed(lambda: decode_answers(card, enc, logits, act), calls),
    }


def through_stub(model: str, card: ModelCard, calls: int) -> dict:
    """1x48 calls through a stub pool (module docstring), p50 / p95 ms each, 6 alternating rounds of `calls`."""
    from benchmarks.common import stub_pool
    from laya_pool import AsyncClient, Client
    state, questions = make_request(card, 1, 48)
    enc = encode_request(card, state, questions)
    zeros = np.zeros(enc.n_markers, np.float32), np.zeros((len(enc.rows), card.n_act), np.float32)

    def local() -> None:
        e = encode_request(card, state, questions)
        decode_answers(card, e, *zeros)
    async def async_round(client: AsyncClient, n: int) -> list[float]:
        xs = []
        for _ in range(n):
            t = time.perf_counter()
            await client.predict(state, questions)
            xs.append((time.perf_counter() - t) * 1e3)
        return xs
    loop = asyncio.new_event_loop()
    with stub_pool(stub_args=["--model", model, "--direct-endpoint", "tcp://127.0.0.1:*"]) as frontend, \
            Client(frontend) as client:
        aclient = AsyncClient(frontend)
        calls_of = {"encode + decode": local, "predict": lambda: client.predict(state, questions),
                    "forward": lambda: client.forward(enc.rows), "ping": client.ping}
        rounds = {k: functools.partial(_round, fn) for k, fn in calls_of.items()}      # n -> n times in ms
        rounds["AsyncClient.predict"] = lambda n: loop.run_until_complete(async_round(aclient, n))
        samples: dict[str, list[float]] = {k: [] for k in rounds}
        try:
            for rnd in range(7):          # the first round warms up
                for k in (list(rounds) if rnd % 2 == 0 else list(rounds)[::-1]):
                    xs = rounds[k](calls)
                    samples[k] += xs if rnd else []
        finally:
            aclient.close()
            # One turn of its loop, so the cancellation of its tasks runs before the loop closes (else they are
            # destroyed pending, and say so at exit).
            loop.run_until_complete(asyncio.sleep(0))
        samples.update(replayed(client, card, state, questions, calls))
    loop.close()
    return {k: percentiles(xs) for k, xs in samples.items()}


def replayed(client: object, card: ModelCard, state: object, questions: dict, calls: int) -> dict[str, list[float]]:
    """`client.predict` with its pool call answered from a recorded reply, against the stages it cannot skip (module
    docstring): 6 x `calls` of each after `calls` of warm-up, one of each in turn (the vCPUs' speed changes hit both
    alike); ms."""
    call = client.call
    recorded = []

    def recording(*args: object, **kwargs: object) -> object:
        recorded.append(call(*args, **kwargs))
        return recorded[-1]

    def replaying(cmd: object, build: Callable, timeout: object = None, retries: object = None,
                  on_sent: Callable | None = None, **kwargs: object) -> object:
        build(1, client.cid)                     # the request's frames, as a call builds them before sending
        if on_sent is not None:
            on_sent()
        return recorded[0]

    def parts() -> None:
        enc = encode_request(card, state, questions)
        wire.encode_request(1, wire.pack_rows(enc.rows), cid=client.cid)
        reply = wire.parse_reply(recorded[0][0])
        decode_answers(card, enc, reply.logits, reply.act)
    client.call = recording
    client.predict(state, questions)
    client.call = replaying
    try:
        kinds = {"predict, reply replayed": lambda: client.predict(state, questions), "encode + wire + decode": parts}
        samples: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(7 * calls):
            for k, fn in kinds.items():
                t = time.perf_counter()
                fn()
                if i >= calls:
                    samples[k].append((time.perf_counter() - t) * 1e3)
    finally:
        del client.call                          # the class's own again
    return samples


def _round(fn: Callable[[], object], n: int) -> list[float]:
    xs = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t) * 1e3)
    return xs


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", required=True, help="a checkpoint directory (only its tokenizer and config are read)")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--stub", action="store_true", help="also 1x48 calls through a pool whose worker answers at once")
    args = ap.parse_args(argv)
    card = ModelCard.from_dir(args.model, fingerprint="-")
    results = [measure(card, r, n, args.calls) for r, n in SHAPES]
    stages = ["encode", "encode whole", "pack", "count", "decode"]
    print("| shape | state tokens (window) | " + " | ".join(f"{s} p50 / p95 ms" for s in stages) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in stages) + " |")
    for r in results:
        cells = " | ".join(f"{r[s]['p50']:.3f} / {r[s]['p95']:.3f}" for s in stages)
        print(f"| {r['shape']} | {r['state_tokens']} ({r['window_tokens']}) | {cells} |")
    if args.stub:
        stub = through_stub(args.model, card, args.calls)
        print("through a stub pool, 1x48, p50 / p95 ms: " + ", ".join(f"{k} {v['p50']:.3f} / {v['p95']:.3f}"
                                                                      for k, v in stub.items()))
        results = {"stages": results, "through_stub": stub}
    write(args.out, "client_speed", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
