"""Drive the worker's real compute thread (`worker.compute.Compute`) in-process, without sockets.

Requests go through the wire codec both ways (encoded, decoded, parsed, as the I/O thread hands them over), and
every reply is parsed back, so what a test sees is what a client would. Used by tests/test_overlap.py (CPU) and
tests/test_serving_gpu.py (device).
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
from laya_pool.protocol import wire
from laya_pool.worker.batch import Batch
from laya_pool.worker.compute import Compute, FaultHooks, Queued

COUNTS = ("received", "ok", "request_errors", "internal_errors", "upload_errors", "dropped", "protocol_errors",
          "handed_back", "registrations", "merged_runs", "merged_requests")


def queued(rid: int, batch: Batch, session: int = 0) -> Queued:
    arrays = {k: getattr(batch, k) for k in wire.REQUEST_ARRAYS}
    req = wire.parse_request(wire.decode(wire.encode_request(rid, arrays)))
    return Queued(session, req, time.monotonic())


def rows(rng: np.random.Generator, n: int, length: int, markers: int, vocab: int = 1000) -> Batch:
    """`n` rows of `length` random tokens, each with `markers` ascending marker positions."""
    return Batch.from_rows([(rng.integers(5, vocab, length).astype(np.int32),
                             np.sort(rng.choice(np.arange(1, length), markers, replace=False)).astype(np.int32),
                             int(rng.integers(0, 3))) for _ in range(n)])


class Driven:
    """A Compute over `runtime`, its replies parsed by request id, and its counters."""

    def __init__(self, runtime: Any, max_group: int, faults: FaultHooks = FaultHooks()):
        self.frames: list[list[Any]] = []
        self.counts = dict.fromkeys(COUNTS, 0)
        self.compute = Compute(runtime, "w0", runtime.fingerprint, max_group, self.frames.append, self.counts,
                               faults)

    def run(self, items: list[Queued], gap_s: float = 0.0) -> dict[Any, wire.Reply]:
        """Feed `items` (all at once, or one every `gap_s` from a feeder thread), then the stop sentinel; run the
        compute loop in this thread until it stops; every request's reply by rid (a second reply fails)."""
        q = self.compute.queue
        if gap_s <= 0:
            for item in items:
                q.put(item)
            q.put(None)
            feeder = None
        else:
            def feed() -> None:
                for item in items:
                    q.put(item)
                    time.sleep(gap_s)
                q.put(None)
            feeder = threading.Thread(target=feed, daemon=True)
            feeder.start()
        self.compute.loop()
        if feeder is not None:
            feeder.join()
        out: dict[Any, wire.Reply] = {}
        for frames in self.frames:
            reply = wire.parse_any_reply(wire.decode(frames))
            assert reply.rid not in out, f"request {reply.rid} answered twice"
            out[reply.rid] = reply
        self.frames.clear()
        missing = [x.req.rid for x in items if x.req.rid not in out]
        assert not missing, f"requests never answered: {missing[:5]}"
        return out
