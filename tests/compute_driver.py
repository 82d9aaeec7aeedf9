"""Drive the worker's real compute thread (`worker.compute.Compute`) in-process.

Requests go through the wire codec both ways (encoded, decoded, parsed, as the I/O thread hands them over), and
every reply is parsed back, so what a test sees is what a client would. Two ways in: a queue (`QueueInbox`, with the
landing-watch thread), or `sockets=True`: the worker's own data socket (`SocketInbox`, the data thread polling its
socket and the launched group's event), fed by a ROUTER on loopback as the broker feeds it. Used by
tests/test_overlap.py (CPU) and tests/test_serving_gpu.py (device).
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import zmq

from laya_pool.protocol import contract, wire
from laya_pool.worker.batch import Batch
from laya_pool.worker.compute import MERGE_WASTE, Compute, FaultHooks, Queued
from laya_pool.worker.inbox import SocketInbox

COUNTS = ("received", "ok", "request_errors", "internal_errors", "upload_errors", "dropped", "protocol_errors",
          "handed_back", "registrations", "merged_runs", "merged_requests", "set_aside", "bundles", "bundled")


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

    def __init__(self, runtime: Any, max_group: int, faults: FaultHooks = FaultHooks(), sockets: bool = False,
                 merge_waste: int | None = MERGE_WASTE):
        self.frames: list[list[Any]] = []
        self.counts = dict.fromkeys(COUNTS, 0)
        self.runtime, self.max_group, self.faults, self.sockets = runtime, max_group, faults, sockets
        self.merge_waste = merge_waste
        self.compute = Compute(runtime, "w0", runtime.fingerprint, max_group,
                               lambda frames, to=None: self.frames.append(frames), self.counts, faults,
                               merge_waste=merge_waste)

    def run(self, items: list[Queued], gap_s: float = 0.0) -> dict[Any, wire.Reply]:
        """Feed `items` (all at once, or one every `gap_s` from a feeder thread), then the stop sentinel; run the
        compute loop in this thread until it stops; every request's reply by rid (a second reply fails)."""
        if self.sockets:
            return self._run_sockets(items, gap_s)
        q = self.compute.inbox
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

    def _run_sockets(self, items: list[Queued], gap_s: float) -> dict[Any, wire.Reply]:
        """As `run`, through a fresh Compute whose inbox is a data socket: a ROUTER (the broker's side) sends each
        request to identity w0/data; the stop sentinel goes in once the data thread has taken every request."""
        feed = DataSocket(self.runtime, self.max_group, self.counts, self.faults, self.merge_waste)
        compute = self.compute = feed.compute
        requests = [wire.encode_request(x.req.rid, x.req.arrays(), mode=x.req.mode, taps=x.req.taps) for x in items]

        def send_all() -> None:
            for frames in requests:
                feed.send(frames)
                if gap_s > 0:
                    time.sleep(gap_s)
            deadline = time.monotonic() + 60
            while compute.taken < len(requests) and time.monotonic() < deadline:
                time.sleep(0.001)
            feed.inbox.put(None)
        feeder = threading.Thread(target=send_all, daemon=True)
        feeder.start()
        try:
            compute.loop()
            feeder.join()
            out = feed.replies(len(items))
        finally:
            feed.close()
        missing = [x.req.rid for x in items if x.req.rid not in out]
        assert not missing, f"requests never answered: {missing[:5]}"
        return out


class DataSocket:
    """A Compute whose inbox is a worker's data socket (`SocketInbox`, identity w0/data), connected to a ROUTER on
    loopback that plays the broker: `send` a request to it, read the `replies`.

    `inproc=True` joins the two in-process instead: a message sent is then in the data socket's queue when `send`
    returns, where over TCP it is still on its way (a test that needs requests there unread needs that)."""

    def __init__(self, runtime: Any, max_group: int, counts: dict[str, int], faults: FaultHooks = FaultHooks(),
                 merge_waste: int | None = MERGE_WASTE, *, inproc: bool = False):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if inproc:
            endpoint = f"inproc://broker-{id(self)}"
            self.router.bind(endpoint)
        else:
            endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.inbox = SocketInbox(self.ctx, endpoint, "w0/data",
                                 max_message_bytes=contract.MAX_BACKEND_BYTES)
        self.compute = Compute(runtime, "w0", runtime.fingerprint, max_group, self.inbox.send, counts, faults,
                               inbox=self.inbox, merge_waste=merge_waste)
        self.inbox.open()

    def send(self, frames: list[Any]) -> None:
        deadline = time.monotonic() + 10
        while True:      # the DEALER's connection is made in the background: wait for the ROUTER to know it
            try:
                wire.send_frames(self.router, [b"w0/data", *frames])
                return
            except zmq.ZMQError:
                assert time.monotonic() < deadline, "the data socket never connected"
                time.sleep(0.001)

    def replies(self, n: int, timeout_s: float = 10.0) -> dict[Any, wire.Reply]:
        """Up to `n` replies by rid, as they come within `timeout_s` each (a second reply to one rid fails)."""
        self.router.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        out: dict[Any, wire.Reply] = {}
        try:
            while len(out) < n:
                frames = self.router.recv_multipart()
                assert frames[0] == b"w0/data", frames[0]
                reply = wire.parse_any_reply(wire.decode(frames[1:]))
                assert reply.rid not in out, f"request {reply.rid} answered twice"
                out[reply.rid] = reply
        except zmq.Again:
            pass
        return out

    def close(self) -> None:
        self.inbox.wake_out.close(0)
        self.router.close(0)
        self.ctx.term()
