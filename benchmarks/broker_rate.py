"""The broker's own ceiling: messages per second through its loop, with real processes and sockets.

    python -m benchmarks.broker_rate --model DIR | --stub | --frontend EP [--kind ping,forward] [--procs 1]
                                     [--window 256] [--seconds 5] [--pool-args "--max-batch 32"] [--out DIR]

Starts a pool (`laya-pool up`: the broker and one worker on --device), then --procs load processes, each
with one DEALER socket keeping --window requests in flight (raw frames built by protocol/wire, a fresh
request id each, so the broker's dedup never short-cuts one). Kinds:

- `ping`: a client HEARTBEAT, which the broker answers itself: 2 broker messages per call (in, out);
- `forward`: one pre-encoded 1x48 row, run by the worker: 4 broker messages per call (client in, worker
  out, worker in, client out). On a CPU worker this measures the worker unless it merges requests.

`--stub` runs a bare broker and `laya_pool/tools/stub_worker.py` (answers at once, without a model) instead of a pool:
the routed path's own ceiling, many messages per wake-up as on a fast GPU. A CPU worker instead wakes the broker
for a few messages at a time while it computes: both are worth a number.

Reports calls/s and broker messages/s (received + sent by the broker) over --seconds after a one-second
warm-up, and the broker's CPU seconds per call (from /proc) when it runs on this host.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import shlex
import sys
import time
from typing import Any

from benchmarks.common import cpu_seconds, parser, stub_pool, write

MESSAGES_PER_CALL = {"ping": 2, "forward": 4}


def _load(endpoint: str, kind: str, window: int, warmup: float, seconds: float, out: Any) -> None:
    """One load process: keep `window` calls in flight; count replies inside the timed span."""
    import uuid

    import numpy as np
    import zmq

    from laya_pool.protocol import wire
    from laya_pool.protocol.wire import Cmd

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.connect(endpoint)
    cid = uuid.uuid4().hex
    rng = np.random.default_rng(0)
    arrays = wire.pack_rows([(rng.integers(10, 1000, 48).astype(np.int32), np.array([5, 8, 11, 14], np.int32), 0)])
    rid = 0

    def build() -> list[Any]:
        nonlocal rid
        rid += 1
        if kind == "ping":
            return wire.encode(Cmd.HEARTBEAT, {"rid": rid})
        return wire.encode_request(rid, arrays, cid=cid)

    for _ in range(window):
        s.send_multipart(build(), copy=False)
    start = time.monotonic()
    t0, t1 = start + warmup, start + warmup + seconds
    counted = errors = 0
    ok_status = b"\xa6status\xa2ok"          # the msgpack of "status": "ok": no full decode per reply
    while True:
        if not s.poll(2000):
            break                                   # the pool stopped answering: report what was counted
        got = ok = 0
        while True:                                 # everything that is there, then as many new calls
            try:
                frames = s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            got += 1
            ok += ok_status in frames[0]                # (the first frame holds the header)
        now = time.monotonic()
        if t0 <= now < t1:
            counted += ok
            errors += got - ok
        if now >= t1:
            break
        for _ in range(got):
            s.send_multipart(build(), copy=False)
    out.put({"calls": counted, "errors": errors})
    s.close(0)
    ctx.term()


def _broker_pid(status: dict[str, Any]) -> int | None:
    return status.get("broker", {}).get("pid")


def run_kind(endpoint: str, kind: str, procs: int, window: int, seconds: float, broker_pid: int | None) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    warmup = 1.0
    workers = [ctx.Process(target=_load, args=(endpoint, kind, window, warmup, seconds, q)) for _ in range(procs)]
    for p in workers:
        p.start()
    time.sleep(0.5 + warmup)    # spawn + warm-up; then the broker's CPU over the timed span
    cpu0 = cpu_seconds(broker_pid) if broker_pid else None
    time.sleep(seconds)
    cpu1 = cpu_seconds(broker_pid) if broker_pid else None
    results = [q.get(timeout=60 + seconds) for _ in workers]
    for p in workers:
        p.join(30)
    calls = sum(r["calls"] for r in results)
    out = {"kind": kind, "procs": procs, "window": window, "seconds": seconds, "calls": calls,
           "errors": sum(r["errors"] for r in results), "calls_per_s": round(calls / seconds, 1),
           "broker_messages_per_s": round(MESSAGES_PER_CALL[kind] * calls / seconds, 1)}
    if cpu0 is not None and calls:
        out["broker_cpu_us_per_call"] = round((cpu1 - cpu0) / calls * 1e6, 2)
        out["broker_cpu_share"] = round((cpu1 - cpu0) / seconds, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    from laya_pool.client.local import local_pool
    from laya_pool.client.pool import Client

    ap = parser(__doc__)
    ap.add_argument("--model", help="the checkpoint for the pool this starts (not with --frontend)")
    ap.add_argument("--frontend", help="load a running pool instead of starting one")
    ap.add_argument("--stub", action="store_true", help="a bare broker and a worker that answers without computing")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kind", default="ping,forward", help="comma-separated: ping, forward")
    ap.add_argument("--procs", type=int, default=1, help="load processes")
    ap.add_argument("--window", type=int, default=256, help="calls each load process keeps in flight")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--pool-args", default="", help="extra `laya-pool up` arguments")
    args = ap.parse_args(argv)
    if not args.model and not args.frontend and not args.stub:
        ap.error("give --model (a pool is started), --stub (a broker and a stub worker) or --frontend (a running pool)")
    kinds = [k.strip() for k in args.kind.split(",") if k.strip()]
    for k in kinds:
        if k not in MESSAGES_PER_CALL:
            ap.error(f"unknown kind {k!r}")
    results = []
    # A queue as deep as the load, so "busy" never answers for the worker.
    extra = ["--queue-size", str(max(1024, 2 * args.procs * args.window)), *shlex.split(args.pool_args)]
    with contextlib.ExitStack() as stack:
        if args.frontend:
            endpoint = args.frontend
        elif args.stub:
            endpoint = stack.enter_context(stub_pool(extra))
        else:
            endpoint = stack.enter_context(local_pool(args.model, args.device, extra_args=extra)).endpoint
        with Client(endpoint, timeout=10) as c:
            broker_pid = _broker_pid(c.status())
        for k in kinds:
            r = run_kind(endpoint, k, args.procs, args.window, args.seconds, broker_pid)
            results.append(r)
            print(json.dumps(r))
    write(args.out, "broker_rate", {"config": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
