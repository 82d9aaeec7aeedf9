"""Where the pool's overhead goes: one small row through a live pool against the same row run in-process.

    python -m benchmarks.overhead --model DIR [--device cpu] [--samples 1000] [--threads 1] [--transport ipc|tcp]
                                  [--client-spin-ms MS] [--burst N] [--pool-args "..."] [--out DIR]

Starts a pool (one worker on --device), and in this process the same runtime the worker runs. After
--warmup untimed calls of every kind, --samples timed calls of each, one of each kind in turn (so drift
and the neighbours' load hit them alike), on the host clock:

- `ping`: client -> broker -> client (the broker answers it itself): the transport and the broker's loop;
- `forward`: `Client.forward` of one 1x48 row through the pool: the default client, which sends it to the worker
  directly when the worker takes it (client/direct.py; on a lane when the worker polls one, protocol/lane.py), else
  through the broker;
- `forward via broker`: the same through the broker always (`Client(direct=False)`), in the same run;
- `in-process`: `Runtime.run` of the same batch here (what the pool adds is `forward` minus this);
- where a forward's time goes, from the reply's timings (the worker's clock is this host's monotonic clock):
  `up` (the call starts -> the worker's data thread reads it: client encode and send, broker, two hops; on a worker
  without `data_requests`, the I/O thread reads it and hands it over), `queue` (-> the data thread starts its
  forward: decode, validation), `worker` (-> answered by the data thread; its `launch` split by the runtime's own
  stamps into `plan`, `pack` and `submit`: the merge, the copies and the graph launch), `down` (-> the call
  returns: reply encode, the data socket, broker, two hops, client decode);
- the CPU cost of each protocol step, timed alone here: the client's request frames and its reply parsing,
  the broker's decode / re-encode of a request and of a reply, the worker's request parsing and validation
  and its reply encoding.

Prints medians with p95 (ms); --out DIR: overhead.json.
"""
from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.common import free_endpoint, parser, percentiles, write
from laya_pool.client.local import local_pool
from laya_pool.client.pool import Client
from laya_pool.protocol import wire
from laya_pool.protocol.wire import Cmd

# What is timed: three kinds of call, then the parts of one pooled forward, in the order a request meets them
# (the worker stamps each on this host's monotonic clock: compute.py `_answer`).
PARTS = ("ping", "forward", "forward via broker", "in-process", "up", "up: to the broker", "up: in the broker",
         "up: to the worker", "queue", "worker", "launch", "launch: plan", "launch: pack", "launch: submit",
         "device wait", "wake", "down", "down: to the broker", "down: to the client")
PART_NOTES = {"up": " (client -> worker's data thread)", "up: to the broker": " (encode, send, hop, broker wakes)",
              "up: in the broker": " (parse, queue, dispatch)", "up: to the worker": " (send, hop, data thread)",
              "queue": " (-> forward starts: admit)",
              "worker": " (received -> reply built)", "launch": " (merge, pack, upload, launch)",
              "launch: plan": " (the graph for the shape)", "launch: pack": " (a slot, rows into it)",
              "launch: submit": " (merge, copies, graph launch)",
              "device wait": " (launched -> readback landed)", "wake": " (landed -> answers cut, reply built)",
              "down": " (reply -> client)", "down: to the broker": " (data socket send, hop)",
              "down: to the client": " (broker, hop, client wakes)"}


def clock(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def one_row() -> list[tuple[np.ndarray, np.ndarray, int]]:
    rng = np.random.default_rng(0)
    return [(rng.integers(10, 1000, 48).astype(np.int32), np.array([5, 8, 11, 14], np.int32), 0)]


def protocol_steps(rows: list, n: int) -> dict[str, dict[str, float]]:
    """Each protocol step's CPU time alone (what the processes do per message, without the sockets)."""
    arrays = wire.pack_rows(rows)
    frames = wire.encode_request(7, arrays, cid="c" * 32)
    msg = wire.decode(frames)
    req = wire.parse_request(msg, need_cid=True)
    to_worker = wire.encode(Cmd.REQUEST, wire.request_header_for_worker(req, 11), *msg.frames)
    logits, act = np.arange(4, dtype=np.float32), np.array([[0.3, 0.7]], np.float32)
    reply = wire.encode_reply(11, logits, act, worker="0", fingerprint="f" * 64,
                              metrics={"mode": "eager", "batched": 1, "queue_ms": 0.1, "worker_ms": 1.0})
    rmsg = wire.decode(reply)

    def broker_reply() -> None:
        m = wire.decode(reply)
        wire.parse_reply(m)
        header = dict(m.header)
        header["rid"], header["worker"] = 7, "0"
        wire.encode(Cmd.REPLY, header, *m.frames)

    steps = {
        "client: pack rows + request frames": lambda: wire.encode_request(7, wire.pack_rows(rows), cid="c" * 32),
        "client: decode + parse reply": lambda: wire.parse_reply(wire.decode(reply)),
        "broker: decode + parse request, re-encode to worker": lambda: wire.encode(
            Cmd.REQUEST, wire.request_header_for_worker(wire.parse_request(wire.decode(frames), need_cid=True), 11),
            *msg.frames),
        "broker: decode + parse reply, re-encode to client": broker_reply,
        "worker: decode + parse request": lambda: wire.parse_request(wire.decode(to_worker)),
        "worker: encode reply": lambda: wire.encode_reply(11, logits, act, worker="0", fingerprint="f" * 64,
                                                          metrics=dict(rmsg.header["metrics"])),
    }
    return {name: percentiles([clock(fn) for _ in range(n)][n // 5:]) for name, fn in steps.items()}


def arguments(argv: list[str] | None) -> Any:
    ap = parser(__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samples", type=int, default=1000, help="timed calls per kind")
    ap.add_argument("--warmup", type=int, default=50, help="untimed calls per kind")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads, here and in the worker (on a small shared CPU, more threads measure "
                         "the neighbours' load more than the pool)")
    ap.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    ap.add_argument("--pool-args", default="", help="extra `laya-pool up` arguments")
    ap.add_argument("--client-spin-ms", type=float, default=None,
                    help="the client polls for its reply without sleeping this long first (Client's spin_ms; "
                         "default: the Client's own)")
    ap.add_argument("--keys", help="a pool with CURVE keys (`laya-pool keys` directory): every connection encrypted, "
                                   "the direct one to the worker's key")
    ap.add_argument("--burst", type=int, default=1,
                    help="calls of one kind in a row per turn (default 1: the kinds interleaved). A forward right "
                         "after a forward finds the worker still polling, so it takes a lane: a loop of forwards, as "
                         "a decision loop (and benchmarks/pool_overhead.py) calls them, wants --burst 20 or so")
    return ap.parse_args(argv)


def in_process(args: Any, rows: list) -> Callable[[], None]:
    """The same batch run by the runtime the worker runs, here (warmed up): what the pool adds is measured over it."""
    import torch

    from laya_pool.worker.batch import Batch
    from laya_pool.worker.checkpoint import load_checkpoint
    from laya_pool.worker.runtime import Runtime, RuntimeConfig

    torch.set_num_threads(args.threads)
    on_cuda = args.device.startswith("cuda")
    rt = Runtime(load_checkpoint(args.model), device=args.device,
                 config=RuntimeConfig(mode="graph-cached" if on_cuda else "eager"))
    rt.warmup()
    batch = Batch.from_rows(rows)

    def run() -> None:
        rt.run(batch)
        if on_cuda:
            torch.cuda.synchronize()
    return run


def record_parts(samples: dict[str, list[float]], m: dict[str, Any], t: float, end: float) -> None:
    """A pooled forward's parts from its reply's stamps (`m`: its metrics; `t`, `end`: when the call started and
    returned, on this host's monotonic clock, which the worker's and the broker's stamps share)."""
    samples["queue"].append(m["queue_ms"])
    samples["worker"].append(m["worker_ms"])
    if "received_at" in m:             # the worker's stamps (compute.py `_answer`)
        samples["up"].append((m["received_at"] - t) * 1e3)
        samples["down"].append((end - m["done_at"]) * 1e3)
    if "broker_in" in m and "received_at" in m:     # the broker's stamps (on the broker's path only)
        samples["up: to the broker"].append((m["broker_in"] - t) * 1e3)
        samples["up: in the broker"].append((m["broker_out"] - m["broker_in"]) * 1e3)
        samples["up: to the worker"].append((m["received_at"] - m["broker_out"]) * 1e3)
        samples["down: to the broker"].append((m["broker_back"] - m["done_at"]) * 1e3)
        samples["down: to the client"].append((end - m["broker_back"]) * 1e3)
    if "landed_at" in m:
        launch = (m["launched_at"] - m["started_at"]) * 1e3
        samples["launch"].append(launch)
        if "plan_ms" in m:             # the runtime's own stamps inside its launch (worker/runtime.py)
            samples["launch: plan"].append(m["plan_ms"])
            samples["launch: pack"].append(m["pack_ms"])
            samples["launch: submit"].append(launch - m["validate_ms"] - m["plan_ms"] - m["pack_ms"])
        samples["device wait"].append((m["landed_at"] - m["launched_at"]) * 1e3)
        samples["wake"].append((m["done_at"] - m["landed_at"]) * 1e3)


def in_turn(kinds: dict[str, Callable[[], Any]], samples: dict[str, list[float]], calls: int, burst: int) -> None:
    """One call (or `burst` calls) of each kind in turn, the order rotating, so load from elsewhere on the machine
    falls on every kind alike."""
    names = list(kinds)
    for i in range(-(-calls // burst)):
        for k in range(len(names)):
            kind = names[(i + k) % len(names)]
            for _ in range(burst):
                samples[kind].append(clock(kinds[kind]))


def measure(args: Any, rows: list, local: Callable[[], None]) -> dict[str, Any]:
    """Every kind's samples and every part's, through a pool of one worker started here."""
    samples: dict[str, list[float]] = {k: [] for k in PARTS}
    extra = ["--threads", str(args.threads), *shlex.split(args.pool_args)]
    frontend = free_endpoint() if args.transport == "tcp" else None
    with local_pool(args.model, args.device, frontend=frontend, extra_args=extra, keys=args.keys) as pool, \
            Client(pool.endpoint, timeout=30, spin_ms=args.client_spin_ms, keys=args.keys) as c, \
            Client(pool.endpoint, timeout=30, spin_ms=args.client_spin_ms, direct=False, keys=args.keys) as via_broker:
        def forward() -> None:
            t = time.monotonic()
            res = c.forward(rows)
            record_parts(samples, res.metrics, t, time.monotonic())

        kinds = {"ping": c.ping, "forward": forward, "forward via broker": lambda: via_broker.forward(rows),
                 "in-process": local}
        for _ in range(args.warmup):
            for fn in kinds.values():
                fn()
        for k in PARTS[4:]:
            del samples[k][:]
        in_turn(kinds, samples, args.samples, max(1, args.burst))
        status = c.status()
    out: dict[str, Any] = {k: percentiles(v) for k, v in samples.items() if v}
    out["added"] = round(out["forward"]["p50"] - out["in-process"]["p50"], 4)
    out["added via broker"] = round(out["forward via broker"]["p50"] - out["in-process"]["p50"], 4)
    out["direct"] = c._routes.sent if c._routes is not None else 0
    out["on_lanes"] = c._routes.on_lanes if c._routes is not None else 0
    out["worker device"] = status["workers"][0]["device"]
    return out


def report(out: dict[str, Any]) -> None:
    print(f"{'':60} {'p50 ms':>8} {'p95 ms':>8}")
    for k in (k for k in PARTS if k in out):
        print(f"{k + PART_NOTES.get(k, ''):60} {out[k]['p50']:8.3f} {out[k]['p95']:8.3f}")
    print(f"{'pool adds (forward - in-process, p50)':60} {out['added']:8.3f}")
    print(f"{'... through the broker (forward via broker - in-process, p50)':60} {out['added via broker']:8.3f}")
    print(f"{'forwards the default client sent to the worker directly':60} {out['direct']:8d}")
    print(f"{'... of them on a lane (shared memory, protocol/lane.py)':60} {out['on_lanes']:8d}")
    for k, v in out["steps"].items():
        print(f"{k:60} {v['p50']:8.4f} {v['p95']:8.4f}")


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    rows = one_row()
    out = measure(args, rows, in_process(args, rows))
    out["steps"] = protocol_steps(rows, 2000)
    out["config"] = {"model": args.model, "device": args.device, "transport": args.transport, "keys": bool(args.keys),
                     "pool_args": args.pool_args, "threads": args.threads, "samples": args.samples,
                     "burst": max(1, args.burst), "worker": out.pop("worker device")}
    report(out)
    write(args.out, "overhead", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
