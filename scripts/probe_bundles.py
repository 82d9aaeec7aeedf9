#!/usr/bin/env python3
"""What bundles and REQUESTS save per message, each side apart (docs/protocol.md, "Bundles"; development CPU numbers in
docs/PERF.md, twenty-fifth session).

    python3 scripts/probe_bundles.py [--rounds 2]

1. A forward's 32 replies to 4 clients (8 each) on a ROUTER over inproc: alone (`Replies.encode`, 32 sends) against
   bundled (`Replies.bundle`, 4 sends); then each client's side: receive, decode (and `unbundle`), `parse_reply`.
2. 16,000 1x48 requests taken through `SocketInbox.get` from its direct socket, with a group computing: sent alone
   against in REQUESTS messages of 8.

Prints us per reply / per request. `scripts/data_thread.py` measures the whole path at once.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import zmq

# The checkout root, for laya_pool where it is not installed.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from laya_pool.protocol import contract, wire  # noqa: E402
from laya_pool.worker.inbox import NOTHING, SocketInbox  # noqa: E402

METRICS = {"mode": "graph-cached", "shape": [32, 48, 4], "first_call": False, "validate_ms": 0.01, "plan_ms": 0.01,
           "pack_ms": 0.05, "device_ms": 3.0, "total_ms": 3.1, "graph": True, "batched": 32, "started_at": 1.0,
           "launched_at": 1.0, "landed_at": 1.0, "done_at": 1.0}
OWN = {"queue_ms": 1.0, "worker_ms": 2.0, "received_at": 1.0}


def replies(ctx: zmq.Context, calls: int = 400) -> dict[str, tuple[float, float]]:
    srv = ctx.socket(zmq.ROUTER)
    srv.bind("inproc://probe-bundles")
    clients = []
    for i in range(4):
        c = ctx.socket(zmq.DEALER)
        c.setsockopt(zmq.IDENTITY, b"c%d" % i)
        c.connect("inproc://probe-bundles")
        clients.append(c)
    time.sleep(0.1)
    logits, act = np.zeros(128, np.float32), np.zeros((32, 2), np.float32)

    def alone() -> None:
        r = wire.Replies(worker="w0", fingerprint="5" * 64, metrics=METRICS, together=True)
        for j in range(32):
            wire.send_frames(srv, [b"c%d" % (j % 4), *r.encode(1000 + j, logits[4 * j:4 * j + 4], act[j:j + 1], OWN)])

    def bundled() -> None:
        r = wire.Replies(worker="w0", fingerprint="5" * 64, metrics=METRICS, together=True)
        for c in range(4):
            items = [(1000 + j, logits[4 * j:4 * j + 4], act[j:j + 1], OWN) for j in range(c, 32, 4)]
            wire.send_frames(srv, [b"c%d" % c, *r.bundle(items)])

    def receive() -> None:
        n = 0
        for c in clients:
            while True:
                try:
                    msg = wire.decode(wire.recv_frames(c))
                except zmq.Again:
                    break
                for m in (wire.unbundle(msg) if msg.cmd == wire.Cmd.BUNDLE else [msg]):
                    wire.parse_reply(m)
                    n += 1
        assert n == 32, n

    out = {}
    for send in (alone, bundled):
        ts = tr = 0.0
        for _ in range(calls):
            a = time.perf_counter()
            send()
            b = time.perf_counter()
            receive()
            ts, tr = ts + b - a, tr + time.perf_counter() - b
        out[send.__name__] = (ts / calls / 32 * 1e6, tr / calls / 32 * 1e6)
    for s in (srv, *clients):
        s.close(0)
    return out


def requests(ctx: zmq.Context, together: bool, n: int = 16000, k: int = 8) -> float:
    rng = np.random.default_rng(0)
    arrays = wire.pack_rows([(rng.integers(5, 1000, 48).astype(np.int32), np.array([3, 9, 20, 30], np.int32), 0)])
    msgs = [wire.with_bundles(wire.with_budget(wire.encode_request(i, arrays, cid="c"), 9000)) for i in range(n)]
    inbox = SocketInbox(ctx, "inproc://nobody", "w0/data", max_message_bytes=contract.MAX_BACKEND_BYTES,
                        direct="tcp://127.0.0.1:*")
    inbox.intake = lambda msg, received, to=None: wire.parse_request(msg, need_cid=True)

    class Computing:                    # a launched group that does not land: the data thread reads as under load
        class job:
            done = staticmethod(lambda: False)
    inbox.oldest = lambda: Computing
    inbox.open()
    c = ctx.socket(zmq.DEALER)
    c.setsockopt(zmq.SNDHWM, 0)
    c.connect(inbox.direct_endpoint)
    time.sleep(0.3)
    for m in ([wire.requests_message(msgs[i:i + k]) for i in range(0, n, k)] if together else msgs):
        wire.send_frames(c, m, wait=True)
    time.sleep(1.0)
    t, got = time.perf_counter(), 0
    while got < n:
        if inbox.get(0.0) is not NOTHING:
            got += 1
    dt = (time.perf_counter() - t) / n * 1e6
    for s in (c, inbox.direct, inbox.sock, inbox.wake_in, inbox.wake_out):
        s.close(0)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    ctx = zmq.Context()
    for _ in range(a.rounds):
        r = replies(ctx)
        for name, (send, read) in r.items():
            print(f"replies {name:8s} worker encode+send {send:5.2f} us a reply, client read {read:5.2f} us a reply")
        print(f"requests: taken alone {requests(ctx, False):5.2f} us a request, in REQUESTS of 8 "
              f"{requests(ctx, True):5.2f}")


if __name__ == "__main__":
    main()
