#!/usr/bin/env python3
"""The worker's data thread at saturation with an instant forward: its CPU a request and the rate it reaches.

    python3 scripts/data_thread.py --model /tmp/tiny [--procs 8] [--window 8] [--modes alone,bundles,together]

The real path, one process: `SocketInbox` (its direct socket) and `Compute` with the CPU `Runtime` (check, plan, pack,
answers all real), whose forward returns zeros of its shape at once; fed by raw client processes on the direct socket,
each keeping --window 1x48 requests in flight, closed loop. Modes (docs/protocol.md, "Bundles"):

- `alone`: each request and each reply a message of its own;
- `bundles`: the requests say `bundle: true`, so the worker answers each client's requests of a forward in one BUNDLE;
- `together`: and each client sends what one message's replies freed as one REQUESTS message.

Prints, per mode, the data thread's CPU a request (`time.thread_time`: the clients' share of the cores does not count)
and requests/s (which does: on a host with few cores the clients compete). On a GPU the forward is not instant; what
this measures is the host work a request costs the thread that also launches the GPU's groups.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from collections import Counter

# The checkout root, for laya_pool where it is not installed.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODES = ("alone", "bundles", "together")


def client(endpoint: str, mode: str, window: int, until: float) -> None:
    """Keep `window` requests in flight until `until` (monotonic), sending as `mode` says."""
    import numpy as np
    import zmq

    from laya_pool.protocol import wire
    from laya_pool.protocol.wire import Cmd

    rng = np.random.default_rng(os.getpid())
    arrays = wire.pack_rows([(rng.integers(5, 900, 48).astype(np.int32), np.array([3, 9, 20, 30], np.int32), 0)])
    s = zmq.Context().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    rid = 0

    def request() -> list:
        nonlocal rid
        rid += 1
        frames = wire.with_budget(wire.encode_request(rid, arrays, cid=f"c{os.getpid()}"), 60_000)
        return frames if mode == "alone" else wire.with_bundles(frames)

    def send(k: int) -> None:
        if mode == "together" and k > 1:
            s.send_multipart(wire.requests_message([request() for _ in range(k)]))
            return
        for _ in range(k):
            s.send_multipart(request())

    for _ in range(window):
        send(1)
    while time.monotonic() < until and s.poll(2000):
        msg = wire.decode(s.recv_multipart())
        send(len(msg.header["replies"]) if msg.cmd == Cmd.BUNDLE else 1)


def measure(model: str, mode: str, procs: int, window: int, seconds: float, max_group: int) -> dict:
    import torch
    import zmq

    from laya_pool.protocol import contract
    from laya_pool.worker.checkpoint import load_checkpoint
    from laya_pool.worker.compute import Compute
    from laya_pool.worker.inbox import SocketInbox
    from laya_pool.worker.runtime import Runtime, RuntimeConfig

    rt = Runtime(load_checkpoint(model), device="cpu", config=RuntimeConfig(mode="eager"))
    n_act = rt.checkpoint.arch.n_act
    zeros: dict = {}

    def instant(shape, taps=None, slot=0):
        if shape not in zeros:
            zeros[shape] = (torch.zeros(shape.rows, shape.row_markers), torch.zeros(shape.rows, n_act))
        return zeros[shape]

    rt._forward = instant
    ctx = zmq.Context()
    broker = ctx.socket(zmq.ROUTER)         # the data socket's peer: it sends nothing
    port = broker.bind_to_random_port("tcp://127.0.0.1")
    inbox = SocketInbox(ctx, f"tcp://127.0.0.1:{port}", "w0/data", max_message_bytes=contract.MAX_BACKEND_BYTES,
                        direct="tcp://127.0.0.1:*")
    counts: Counter = Counter()
    compute = Compute(rt, "w0", rt.fingerprint, max_group, inbox.send, counts, inbox=inbox)
    inbox.open()
    # The clients' start (a spawned interpreter each), a warm-up, then the measured span; they stop after it.
    t_warm = time.monotonic() + 3.5
    t_end = t_warm + seconds
    spawn = mp.get_context("spawn")
    clients = [spawn.Process(target=client, args=(inbox.direct_endpoint, mode, window, t_end + 1.0))
               for _ in range(procs)]
    for p in clients:
        p.start()
    # Compute.loop's body, one group at a time, between two marks on this thread's CPU clock.
    marks: dict = {}
    while time.monotonic() < t_end:
        if "start" not in marks and time.monotonic() >= t_warm:
            marks["start"] = (time.thread_time(), time.perf_counter(), counts["ok"])
        first = compute._next()
        if not hasattr(first, "req"):
            continue
        members, group, held, _ = compute.take_group(first)
        while members:
            compute.run_group(members, group)
            if held is None:
                break
            members, group, held, _ = compute.take_group(held)
    cpu0, wall0, ok0 = marks["start"]
    cpu, wall, ok = time.thread_time() - cpu0, time.perf_counter() - wall0, counts["ok"] - ok0
    for p in clients:
        p.join(10)
    inbox.direct.close(0)
    broker.close(0)
    return {"mode": mode, "requests": ok, "cpu_us_per_request": round(cpu / ok * 1e6, 2) if ok else None,
            "requests_per_s": round(ok / wall), "bundled": counts["bundled"],
            "requests_messages": inbox.requests_messages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a checkpoint directory (its size does not matter here)")
    ap.add_argument("--procs", type=int, default=8, help="client processes")
    ap.add_argument("--window", type=int, default=8, help="requests each keeps in flight")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--max-group", type=int, default=32)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    for _ in range(a.rounds):
        for mode in a.modes.split(","):
            r = measure(a.model, mode, a.procs, a.window, a.seconds, a.max_group)
            print(f"{mode:9s} {r['cpu_us_per_request']:7.2f} us of the data thread a request, {r['requests_per_s']:6d} "
                  f"requests/s ({r['requests']} requests; {r['bundled']} replies in bundles, "
                  f"{r['requests_messages']} REQUESTS messages)", flush=True)


if __name__ == "__main__":
    main()
