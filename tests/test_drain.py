"""A draining worker's data thread: what reached it before it stopped reading.

The race (seen by tests/test_pool.py::test_sigterm_finishes_in_flight_work_and_exits_0 on a loaded 2-core
machine): the broker had routed a request to worker 1 (addressed to it), SIGTERM came before the data thread read it,
the I/O thread found nothing in flight and left, and the request, handed back, waited in the broker for a worker 1
that never came back. Here the same moment is set up for real, deterministically: requests unread in the data
socket, the worker draining, the stop sentinel handed over first.
"""
from __future__ import annotations

import numpy as np
import pytest
import zmq
from compute_driver import COUNTS, DataSocket, rows

from laya_pool.protocol import wire
from laya_pool.protocol.contract import Reason
from laya_pool.worker.checkpoint import load_checkpoint
from laya_pool.worker.runtime import Runtime, RuntimeConfig
from laya_pool.worker.workspace import Capacity

CAP = Capacity(max_tokens=4096, max_rows=64, max_markers=1024, row_markers=32)


def _leave_with_unread(runtime, requests: list[list]) -> dict:
    """Send `requests` to a data thread's socket, wait until they are there unread, drain (as the I/O thread does on
    SIGTERM), hand over the stop sentinel, run the data thread to its end; every reply by rid."""
    # In-process: every request is in the data socket's queue once sent. Over TCP the poll below woke on the first
    # to arrive and the drain could read before the rest came ("answered [0] of 4" on a loaded machine).
    feed = DataSocket(runtime, 4, dict.fromkeys(COUNTS, 0), inproc=True)
    try:
        for frames in requests:
            feed.send(frames)
        assert feed.inbox.sock.poll(10_000, zmq.POLLIN), "the requests never reached the data socket"
        feed.compute.stopping = True     # `Worker._drain`
        feed.inbox.put(None)             # `Worker._leave`: nothing was in flight
        feed.compute.loop()
        out = feed.replies(len(requests))
    finally:
        feed.close()
    assert len(out) == len(requests), f"answered {sorted(out)} of {len(requests)}"
    return out


def _as_broker_sends(job: int, arrays: dict, worker: str | None = None) -> list:
    """A client's request (addressed to `worker`) as the broker forwards it: its header rebuilt by the broker's own
    function (a first version of this test sent the client's header, which the broker does not: it passed while the
    worker never saw whom a request was addressed to)."""
    msg = wire.decode(wire.encode_request(7, arrays, cid="c", worker=worker))
    head = wire.parse_request_head(msg, need_cid=True)
    return wire.encode(wire.Cmd.REQUEST, wire.request_header_for_worker(head, job), *msg.frames)


@pytest.fixture(scope="module")
def runtime(tiny_ckpt):
    return Runtime(load_checkpoint(tiny_ckpt), config=RuntimeConfig(capacity=CAP))


def test_a_draining_worker_runs_what_is_addressed_to_it_and_hands_back_the_rest(runtime):
    rng = np.random.default_rng(3)
    batches = [rows(rng, 2, 30, 3) for _ in range(4)]
    arrays = [{k: getattr(b, k) for k in wire.REQUEST_ARRAYS} for b in batches]
    # rid 0 and 2 for any worker, 1 addressed to this one, 3 to another
    requests = [_as_broker_sends(0, arrays[0]), _as_broker_sends(1, arrays[1], worker="w0"),
                _as_broker_sends(2, arrays[2]), _as_broker_sends(3, arrays[3], worker="w1")]
    got = _leave_with_unread(runtime, requests)
    for rid in (0, 2, 3):
        assert got[rid].status == wire.STATUS_RETRYABLE and got[rid].error["reason"] == Reason.STOPPING, rid
    assert got[1].status == wire.STATUS_OK, got[1].message
    want = runtime.run(batches[1])
    np.testing.assert_array_equal(got[1].logits, want.logits)
