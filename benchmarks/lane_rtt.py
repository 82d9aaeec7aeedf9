"""One round trip between two processes: through a lane (protocol/lane.py; the worker polling, the client polling or
asleep on the lane's futex) against a ROUTER/DEALER pair (tcp and ipc; each end polling, or sleeping in its poll),
with a 1x48 request's and reply's sizes.

    python -m benchmarks.lane_rtt [--samples 3000] [--out DIR]

What the pool's two direct hops cost beyond the work at either end (docs/architecture.md, "The data path", item 4).
Prints p50 / p95 in microseconds per configuration.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time

import zmq

from benchmarks.common import free_endpoint, parser, percentiles, write
from laya_pool.protocol.lane import Lane

REQUEST = [b"LAYA3\x02" + b"h" * 120, b"r" * 220]       # ~ a 1x48 request's frames
REPLY = [b"LAYA3\x03" + b"h" * 200, b"l" * 64, b"a" * 16]


def _socket_end(endpoint: str, spin: bool) -> None:
    s = zmq.Context().socket(zmq.ROUTER)
    s.bind(endpoint)
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    while True:
        while not poller.poll(0 if spin else 1000):
            pass
        frames = s.recv_multipart()
        if frames[1] == b"stop":
            return
        s.send_multipart([frames[0], *REPLY])


def _lane_end(name: str, secret: str) -> None:
    lane = Lane.open(name, secret)
    lane.set_awake(True)          # the other end asks once it sees this (as a client waits for the worker's yes)
    while True:
        frames = lane.asked()
        if frames is None:
            continue
        if frames == [b"stop"]:
            lane.reply([b"ok"])
            lane.close()
            return
        lane.reply(REPLY)


def _summary(label: str, ts: list[float], out: dict[str, dict[str, float]]) -> None:
    out[label] = percentiles(ts)
    print(f"{label:44s} p50 {out[label]['p50']:8.1f} us   p95 {out[label]['p95']:8.1f} us", flush=True)


def sockets(endpoint: str, spin_server: bool, spin_client: bool, samples: int) -> list[float]:
    end = mp.Process(target=_socket_end, args=(endpoint, spin_server))
    end.start()
    c = zmq.Context().socket(zmq.DEALER)
    c.connect(endpoint)
    poller = zmq.Poller()
    poller.register(c, zmq.POLLIN)
    ts = []
    for i in range(samples + 200):
        t = time.perf_counter()
        c.send_multipart(REQUEST)
        while not poller.poll(0 if spin_client else 1000):
            pass
        c.recv_multipart()
        if i >= 200:
            ts.append((time.perf_counter() - t) * 1e6)
    c.send_multipart([b"stop"])
    end.join()
    c.close(0)
    return ts


def lane(samples: int, asleep: bool = False) -> list[float]:
    mine = Lane.create()
    end = mp.Process(target=_lane_end, args=(mine.name, mine.secret()))
    end.start()
    ts = []
    try:
        while not mine.worker_awake():
            time.sleep(0.001)
        for i in range(samples + 200):
            t = time.perf_counter()
            mine.ask(REQUEST)
            while not mine.free():
                if asleep:
                    mine.sleep(0.002)     # the futex the worker's answer wakes (a client not polling)
            mine.answer()
            if i >= 200:
                ts.append((time.perf_counter() - t) * 1e6)
        mine.ask([b"stop"])
        end.join()
    finally:
        mine.unlink()
        mine.close()
    return ts


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--samples", type=int, default=3000)
    a = ap.parse_args(argv)
    us: dict[str, dict[str, float]] = {}
    print(f"{os.cpu_count()} cores; one round trip, request {sum(map(len, REQUEST))} B, reply {sum(map(len, REPLY))} B")
    _summary("lane, both ends polling", lane(a.samples), us)
    _summary("lane, polling worker, client asleep (futex)", lane(a.samples, asleep=True), us)
    with tempfile.TemporaryDirectory() as d:
        for kind in ("tcp", "ipc"):
            for spin_server, spin_client in ((True, True), (True, False), (False, False)):
                ep = free_endpoint() if kind == "tcp" else f"ipc://{d}/rtt"
                ends = f"{'polling' if spin_server else 'sleeping'} worker, {'polling' if spin_client else 'sleeping'}"
                _summary(f"{kind} sockets, {ends} client", sockets(ep, spin_server, spin_client, a.samples), us)
    write(a.out, "lane_rtt", {"us": us})
    return 0


if __name__ == "__main__":
    sys.exit(main())
