#!/usr/bin/env python3
"""Workers that answer without computing: the broker's paths measured on their own.

    python -m laya_pool.tools.stub_worker --backend EP [--id stub] [--credit 64] [--fingerprint HEX | --model DIR]
                                          [--workers N] [--keys DIR] [--direct-endpoint tcp://HOST:*]

Each registers like a real worker (READY with a capacity and a fingerprint), heartbeats, and answers every REQUEST
at once with an `ok` reply of the right shape: logits [M], act [R, 2] and a metrics map the size of a real
worker's (the broker decodes and re-encodes what a real worker sends, so the stub sends as much). A DESCRIBE gets
a small card. With it, `python -m benchmarks.broker_rate --stub` finds the routed forward's ceiling, which a CPU worker
hides (every call then wakes the broker alone), and `python -m benchmarks.scale` stands in 8 hosts of 8 workers.
With `--model DIR` it serves that checkpoint's fingerprint and card (no tensors read), so clients that encode and
decode (`predict`, the HTTP gateway) run against it: `python -m benchmarks.http --stub` measures the gateway's own
ceiling.

- `--workers N`: N workers in this process (threads; ids ID-0 ... ID-N-1), as one host's;
- `--keys DIR`: CURVE, as a worker of a pool with keys (the worker key pair towards the broker);
- `--direct-endpoint`: each also takes clients' requests on a socket of its own there (announced in its READY, a
  CURVE server with the worker key pair admitting `authorized/` with keys), as a GPU worker does: the broker is then
  only the control plane for those requests.

Not a worker: no validation, no model. For measurements only.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path
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


def reply_frames(rid: int, rows: int, markers: int, wid: str, fp: str, metrics: dict, n_act: int = N_ACT) -> list[Any]:
    """An ok reply to job `rid`: zeros of the sizes its header promises."""
    header = {"rid": rid, "status": wire.STATUS_OK, "markers": markers, "rows": rows, "n_act": n_act,
              "worker": wid, "fp": fp, "metrics": metrics}
    return [wire.PROTOCOL + bytes((Cmd.REPLY,)) + msgpack.packb(header), bytes(4 * markers), bytes(4 * rows * n_act)]


def _sockets(ctx: zmq.Context, backend: str, wid: str, keys: str | None,
             direct: str | None) -> tuple[zmq.Socket, zmq.Socket | None, dict[str, str]]:
    """The worker's DEALER to the broker, its direct ROUTER (or None), and what READY says of the latter."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, wid.encode())
    s.setsockopt(zmq.LINGER, 0)
    if keys:
        wire.configure_curve_client(s, keys, role="worker")
    s.connect(backend)
    if direct is None:
        return s, None, {}
    d = ctx.socket(zmq.ROUTER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.ROUTER_MANDATORY, 1)
    said = {}
    if keys:
        said["direct_key"] = wire.configure_curve_server(d, keys, "worker", "clients").decode()
    d.bind(direct)
    said["direct"] = d.getsockopt_string(zmq.LAST_ENDPOINT)
    return s, d, said


def serve(backend: str, wid: str, credit: int, fp: str, heartbeat_s: float = 1.0, *, keys: str | None = None,
          direct: str | None = None, ctx: zmq.Context | None = None, card: bytes | None = None,
          n_act: int = N_ACT) -> int:
    """`card`: the packed model card a DESCRIBE gets (default: the fingerprint alone); `n_act`: its acts."""
    s, d, said = _sockets(ctx or zmq.Context.instance(), backend, wid, keys, direct)
    ready = {"id": wid, "device": "stub", "fingerprint": fp, "credit": credit, "pid": os.getpid(), "mode": "eager",
             "generation": 0, "host": socket.gethostname(), **said,
             "capacity": {"max_tokens": 1 << 20, "max_rows": 1 << 12, "max_markers": 1 << 14, "row_markers": 64},
             "limits": {"vocab_size": 1 << 16, "max_len": 8192}}
    token = credentials.read(credentials.WORKER, backend)      # as a worker proves it: the broker's worker secret
    if token:
        ready["proof"] = credentials.proof(token, wid.encode())
    s.send_multipart(wire.encode(Cmd.READY, ready))
    metrics = metrics_like_a_worker()
    poller = zmq.Poller()
    for sock in (s, d) if d is not None else (s,):
        poller.register(sock, zmq.POLLIN)
    last_sent = time.monotonic()
    while True:
        events = dict(poller.poll(int(heartbeat_s * 1000)))
        if events.get(s):
            last_sent = _drain(s, lambda frames: _answer(s, frames, wid, fp, metrics, ready, card, n_act), last_sent)
        if d is not None and events.get(d):
            _drain(d, lambda frames: _answer_direct(d, frames, wid, fp, metrics, n_act), last_sent)
        if time.monotonic() - last_sent >= heartbeat_s:
            s.send_multipart(wire.encode(Cmd.HEARTBEAT, {"stats": {}}))
            last_sent = time.monotonic()


def _drain(sock: zmq.Socket, answer: Any, last_sent: float) -> float:
    """Answer everything `sock` holds; when the last message was sent (to the broker, for the heartbeats)."""
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return last_sent
        answer(frames)
        last_sent = time.monotonic()


def _answer(s: zmq.Socket, frames: list[bytes], wid: str, fp: str, metrics: dict, ready: dict,
            card: bytes | None = None, n_act: int = N_ACT) -> None:
    cmd = frames[0][wire.HEAD - 1]
    if cmd == Cmd.REQUEST:
        h = msgpack.unpackb(frames[0][wire.HEAD:])
        s.send_multipart(reply_frames(h["rid"], h["rows"], h["markers"], wid, fp, metrics, n_act), copy=False)
    elif cmd == Cmd.DESCRIBE:
        h = msgpack.unpackb(frames[0][wire.HEAD:])
        if card is None:
            s.send_multipart(wire.encode_body_reply(Cmd.DESCRIBE, h["rid"], {"fingerprint": fp}))
        else:                         # as a worker answers it (worker/server.py)
            s.send_multipart(wire.encode(Cmd.DESCRIBE, {"rid": h["rid"], "status": wire.STATUS_OK, "fp": fp}, card))
    elif cmd == Cmd.DISCONNECT:
        s.send_multipart(wire.encode(Cmd.READY, ready))
    elif cmd == Cmd.DRAIN:
        s.send_multipart(wire.encode(Cmd.DISCONNECT, {"reason": "drain"}))
        sys.exit(0)


def _answer_direct(d: zmq.Socket, frames: list[bytes], wid: str, fp: str, metrics: dict, n_act: int = N_ACT) -> None:
    """A client's own request ([its identity, the request's frames]): the reply goes back to it."""
    if len(frames) < 2 or frames[1][wire.HEAD - 1] != Cmd.REQUEST:
        return
    h = msgpack.unpackb(frames[1][wire.HEAD:])
    try:
        reply = reply_frames(h["rid"], h["rows"], h["markers"], wid, fp, metrics, n_act)
        d.send_multipart([frames[0], *reply], copy=False)
    except zmq.ZMQError:
        pass            # the client left


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--id", default="stub")
    ap.add_argument("--credit", type=int, default=64)
    ap.add_argument("--fingerprint", default=STUB_FINGERPRINT)
    ap.add_argument("--model", default=None, help="serve this checkpoint's fingerprint and card (no tensors read)")
    ap.add_argument("--workers", type=int, default=1, help="workers in this process (ids ID-0, ID-1, ...)")
    ap.add_argument("--keys", default=None, help="the pool's CURVE key directory")
    ap.add_argument("--direct-endpoint", default=None, help="each worker's direct socket, e.g. tcp://127.0.0.1:*")
    a = ap.parse_args(argv)
    a.card, a.n_act = None, N_ACT
    if a.model:
        from laya_pool.worker.checkpoint import load_checkpoint
        ckpt = load_checkpoint(a.model, with_tensors=False)
        a.fingerprint, a.card, a.n_act = ckpt.fingerprint, wire.pack(ckpt.card()), ckpt.arch.n_act
    if a.workers == 1:
        return _run_one(a, a.id)
    threads = [threading.Thread(target=_run_one, args=(a, f"{a.id}-{i}"), daemon=True) for i in range(a.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0


_AUTH: list[Any] = []
_AUTH_LOCK = threading.Lock()


def _run_one(a: argparse.Namespace, wid: str) -> int:
    if a.keys and a.direct_endpoint:
        with _AUTH_LOCK:          # one ZAP handler for the process's direct sockets, before the first binds
            if not _AUTH:
                _AUTH.append(wire.start_authenticator(zmq.Context.instance(), {"clients": Path(a.keys) / "authorized"}))
    return serve(a.backend, wid, a.credit, a.fingerprint, keys=a.keys, direct=a.direct_endpoint, card=a.card,
                 n_act=a.n_act)


if __name__ == "__main__":
    sys.exit(main())
