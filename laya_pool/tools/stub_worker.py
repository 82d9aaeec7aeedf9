#!/usr/bin/env python3
"""A worker that answers without computing: the broker's routed path measured on its own.

    python -m laya_pool.tools.stub_worker --backend EP [--id stub] [--credit 64] [--fingerprint HEX]

It registers like a real worker (READY with a capacity and a fingerprint), heartbeats, and answers every REQUEST
at once with an `ok` reply of the right shape: logits [M], act [R, 2] and a metrics map the size of a real
worker's (the broker decodes and re-encodes what a real worker sends, so the stub sends as much). A DESCRIBE gets
a small card. With it, `python -m benchmarks.broker_rate --stub` finds the routed forward's ceiling, which a CPU worker
hides (every call then wakes the broker alone).

Not a worker: no validation, no model. For measurements only.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import msgpack
import zmq

from laya_pool.protocol import credentials, wire
from laya_pool.protocol.wire import Cmd

STUB_FINGERPRINT = "5" * 64
N_ACT = 2


def metrics_like_a_worker() -> dict[str, Any]:
    """The metrics a CPU worker's reply carries (keys and kinds of values; benchmarks/broker_rate.py's docstring)."""
    now = time.monotonic()
    return {"mode": "eager", "shape": [1, 48, 4], "first_call": False, "validate_ms": 0.0003, "plan_ms": 0.021,
            "pack_ms": 0.068, "device_ms": 0.5, "total_ms": 0.6, "batched": 1, "queue_ms": 0.1, "worker_ms": 0.7,
            "received_at": now, "started_at": now, "launched_at": now, "landed_at": now, "done_at": now}


def reply_frames(rid: int, rows: int, markers: int, wid: str, fp: str, metrics: dict) -> list[Any]:
    """An ok reply to job `rid`: zeros of the sizes its header promises."""
    header = {"rid": rid, "status": wire.STATUS_OK, "markers": markers, "rows": rows, "n_act": N_ACT,
              "worker": wid, "fp": fp, "metrics": metrics}
    return [wire.PROTOCOL + bytes((Cmd.REPLY,)) + msgpack.packb(header), bytes(4 * markers), bytes(4 * rows * N_ACT)]


def serve(backend: str, wid: str, credit: int, fp: str, heartbeat_s: float = 1.0) -> int:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, wid.encode())
    s.setsockopt(zmq.LINGER, 0)
    s.connect(backend)
    ready = {"id": wid, "device": "stub", "fingerprint": fp, "credit": credit, "pid": os.getpid(), "mode": "eager",
             "generation": 0, "host": "stub",
             "capacity": {"max_tokens": 1 << 20, "max_rows": 1 << 12, "max_markers": 1 << 14, "row_markers": 64},
             "limits": {"vocab_size": 1 << 16, "max_len": 8192}}
    token = credentials.read(credentials.WORKER, backend)      # as a worker proves it: the broker's worker secret
    if token:
        ready["proof"] = credentials.proof(token, wid.encode())
    s.send_multipart(wire.encode(Cmd.READY, ready))
    metrics = metrics_like_a_worker()
    last_sent = time.monotonic()
    while True:
        if s.poll(int(heartbeat_s * 1000)):
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                _answer(s, frames, wid, fp, metrics, ready)
                last_sent = time.monotonic()
        if time.monotonic() - last_sent >= heartbeat_s:
            s.send_multipart(wire.encode(Cmd.HEARTBEAT, {"stats": {}}))
            last_sent = time.monotonic()


def _answer(s: zmq.Socket, frames: list[bytes], wid: str, fp: str, metrics: dict, ready: dict) -> None:
    cmd = frames[0][wire.HEAD - 1]
    if cmd == Cmd.REQUEST:
        h = msgpack.unpackb(frames[0][wire.HEAD:])
        s.send_multipart(reply_frames(h["rid"], h["rows"], h["markers"], wid, fp, metrics), copy=False)
    elif cmd == Cmd.DESCRIBE:
        h = msgpack.unpackb(frames[0][wire.HEAD:])
        s.send_multipart(wire.encode_body_reply(Cmd.DESCRIBE, h["rid"], {"fingerprint": fp}))
    elif cmd == Cmd.DISCONNECT:
        s.send_multipart(wire.encode(Cmd.READY, ready))
    elif cmd == Cmd.DRAIN:
        s.send_multipart(wire.encode(Cmd.DISCONNECT, {"reason": "drain"}))
        sys.exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--id", default="stub")
    ap.add_argument("--credit", type=int, default=64)
    ap.add_argument("--fingerprint", default=STUB_FINGERPRINT)
    a = ap.parse_args(argv)
    return serve(a.backend, a.id, a.credit, a.fingerprint)


if __name__ == "__main__":
    sys.exit(main())
