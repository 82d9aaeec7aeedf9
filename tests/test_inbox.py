"""The data thread's inbox (worker/inbox.py `SocketInbox`, its reading in worker/reading.py) on real sockets: with a
group computing it reads the socket that last gave a request again without a poll (hot reads); every request is still
taken exactly once from either socket, a landed group is still seen, and with nothing computing it never reads without
a poll."""
from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from laya_pool.protocol import contract, wire
from laya_pool.worker import inbox as inbox_module
from laya_pool.worker.inbox import NOTHING, SocketInbox
from laya_pool.worker.reading import HOT_READS


class _Flight:
    """A launched group whose `job.done()` the test sets."""

    def __init__(self):
        self.landed = False
        self.job = self

    def done(self) -> bool:
        return self.landed


def _request(rid: int) -> list[bytes]:
    arrays = wire.pack_rows([(np.arange(5, 21, dtype=np.int32), np.array([2, 7], np.int32), 0)])
    return [bytes(f) for f in wire.encode_request(rid, arrays, cid="c")]


@pytest.fixture
def sockets():
    """(inbox, the broker's ROUTER, a client's DEALER on the direct socket, the launched group or None)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    inbox = SocketInbox(ctx, f"tcp://127.0.0.1:{port}", "w0/data", max_message_bytes=contract.MAX_BACKEND_BYTES,
                        direct="tcp://127.0.0.1:*")
    inbox.intake = lambda msg, received, to=None: wire.parse_request(msg).rid
    inbox.open()
    client = ctx.socket(zmq.DEALER)
    client.connect(inbox.direct_endpoint)
    held: dict[str, _Flight | None] = {"flight": None}
    inbox.oldest = lambda: held["flight"]
    yield inbox, router, client, held
    for s in (router, client, inbox.sock, inbox.direct, inbox.wake_in, inbox.wake_out):
        s.close(0)
    ctx.term()


def _send_all(router, client, n: int) -> None:
    for rid in range(n):
        while True:      # the data socket's connection is made in the background: wait until the ROUTER knows it
            try:
                wire.send_frames(router, [b"w0/data", *_request(rid)], wait=True)
                break
            except zmq.ZMQError:
                time.sleep(0.01)
        wire.send_frames(client, _request(1000 + rid), wait=True)
    time.sleep(0.3)      # all of them in the worker's pipes


def _take(inbox, n: int) -> list:
    got, deadline = [], time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        item = inbox.get(0.0)
        if item is not NOTHING:
            got.append(item)
    return got


class _CountedPolls:
    """The inbox's poller, counting the polls that found a socket ready."""

    def __init__(self, poller):
        self.poller, self.found = poller, 0

    def poll(self, timeout=None):
        ready = self.poller.poll(timeout)
        self.found += bool(ready)
        return ready

    def __getattr__(self, name):
        return getattr(self.poller, name)


def test_with_a_group_computing_every_request_is_taken_once_and_the_landing_after(sockets):
    inbox, router, client, held = sockets
    flight = held["flight"] = _Flight()
    _send_all(router, client, 40)
    polls = _CountedPolls(inbox.poller)
    inbox.poller = polls
    got = _take(inbox, 80)
    assert sorted(got) == list(range(40)) + list(range(1000, 1040))
    # A request a poll did not find came from a hot read (the socket read again without a poll).
    assert polls.found < len(got), f"{polls.found} polls found {len(got)} requests: no hot read, the test shows nothing"
    assert inbox.get(0.0) is NOTHING             # drained: the read that found nothing went back to polling
    assert inbox.hot is None
    flight.landed = True
    assert isinstance(inbox.get(0.0), inbox_module.Landed)


def test_with_nothing_computing_every_read_follows_a_poll(sockets, monkeypatch):
    inbox, router, client, _ = sockets
    polls = []
    poll = inbox._poll_sockets
    monkeypatch.setattr(inbox, "_poll_sockets", lambda: polls.append(1) or poll())
    _send_all(router, client, 10)
    got = _take(inbox, 20)
    assert sorted(got) == list(range(10)) + list(range(1000, 1010))
    assert inbox.hot_reads == 0 and len(polls) >= 20


@pytest.mark.parametrize("together", [False, True])
def test_a_requests_message_does_not_keep_the_brokers_request_waiting(sockets, together):
    """A client's requests, alone or in REQUESTS messages of 64, with a group computing and the direct socket hot:
    the broker's request, waiting from the start, is taken after at most HOT_READS of them and a few (a REQUESTS'
    requests are taken HOT_READS at a time, then the sockets get a read), and every request is taken once."""
    inbox, router, client, held = sockets
    held["flight"] = _Flight()
    _send_all(router, client, 1)                      # the data socket connected; its request and the client's first
    assert sorted(_take(inbox, 2)) == [0, 1000]
    n = 1024 if together else 64
    direct = [_request(2000 + i) for i in range(n)]
    if together:
        for at in range(0, n, 64):
            wire.send_frames(client, wire.requests_message(direct[at:at + 64]), wait=True)
    else:
        for frames in direct:
            wire.send_frames(client, frames, wait=True)
    time.sleep(0.3)
    assert inbox.get(0.0) == 2000                     # the direct socket is hot now
    wire.send_frames(router, [b"w0/data", *_request(7)], wait=True)
    time.sleep(0.3)
    got = [2000] + _take(inbox, n)
    assert sorted(got) == [7] + list(range(2000, 2000 + n))
    assert got.index(7) <= HOT_READS + 2, got.index(7)


def test_a_poll_that_finds_nothing_ends_the_hot_socket_even_with_its_reads_spent(sockets):
    """The hot socket's HOT_READS spent, the next read is a poll; finding nothing, it leaves no socket hot (the state
    the drained inbox above asserts, whichever read the last request came from)."""
    from laya_pool.worker.reading import HOT_READS
    inbox, router, client, held = sockets
    held["flight"] = _Flight()
    inbox.hot, inbox.hot_reads = inbox.direct, HOT_READS
    assert inbox.get(0.0) is NOTHING
    assert inbox.hot is None
