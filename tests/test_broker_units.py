"""The broker's pure parts, from tables: the reply cache's limits, the worker states, the requeue rule."""
from __future__ import annotations

import time

import pytest

from laya_pool.broker.broker import Broker, BrokerConfig
from laya_pool.broker.dispatch import Job
from laya_pool.broker.replies import ReplyCache
from laya_pool.protocol import credentials, wire
from laya_pool.protocol.contract import WorkerState

# ------------------------------------------------------------------------------------------------ ReplyCache

LIMITS = dict(max_entries=3, max_bytes=100, ttl_s=10.0, max_reply_bytes=40)


def _frames(n: int) -> list[bytes]:
    return [b"h", b"x" * (n - 1)]


# (what, [(op, key, bytes, now)], keys left oldest first, bytes held)
CACHE = [
    ("kept", [("put", "a", 10, 0)], ["a"], 10),
    ("entry limit drops the oldest", [("put", k, 10, 0) for k in "abcd"], ["b", "c", "d"], 30),
    ("byte limit drops the oldest", [("put", "a", 40, 0), ("put", "b", 40, 0), ("put", "c", 30, 0)], ["b", "c"], 70),
    ("a reply over the per-reply limit is not kept", [("put", "a", 41, 0)], [], 0),
    ("the per-reply limit is inclusive", [("put", "a", 40, 0)], ["a"], 40),
    ("a second put replaces and moves to the back", [("put", "a", 10, 0), ("put", "b", 10, 0), ("put", "a", 20, 1)],
     ["b", "a"], 30),
    ("expire drops what is older than ttl", [("put", "a", 10, 0), ("put", "b", 10, 5), ("expire", None, 0, 10.5)],
     ["b"], 10),
    ("expire keeps what is exactly at its ttl", [("put", "a", 10, 0), ("expire", None, 0, 10.0)], ["a"], 10),
    ("expire of everything", [("put", "a", 10, 0), ("put", "b", 10, 1), ("expire", None, 0, 99)], [], 0),
]


@pytest.mark.parametrize("ops,keys,held", [(o, k, b) for _, o, k, b in CACHE], ids=[c[0] for c in CACHE])
def test_reply_cache(ops, keys, held):
    c = ReplyCache(**LIMITS)
    for op, key, n, now in ops:
        if op == "put":
            c.put(key, _frames(n), now)
        else:
            c.expire(now)
    assert [k for k in "abcd" if k in c] == sorted(keys) and len(c) == len(keys)
    assert list(c._items) == keys, "oldest first"
    assert c.bytes == held


def test_reply_cache_get_and_put_results():
    c = ReplyCache(**LIMITS)
    assert c.get("a") is None
    assert c.put("a", _frames(10), 0) is True and c.get("a") == _frames(10)
    assert c.put("big", _frames(41), 0) is False and c.get("big") is None
    assert c.expire(5) == 0 and c.expire(11) == 1


# ------------------------------------------------------------------------------------------------ WorkerState

STATES = {  # state: (live, connected, dispatchable)
    WorkerState.READY: (True, True, True),
    WorkerState.DRAINING: (True, True, False),
    WorkerState.MISMATCH: (False, True, True),
    WorkerState.RESTARTING: (False, False, False),
    WorkerState.DRAINED: (False, False, False),
    WorkerState.STOPPED: (False, False, False),
    WorkerState.DEAD: (False, False, False),
}


@pytest.mark.parametrize("state", list(WorkerState))
def test_worker_state_predicates(state):
    assert (state.live, state.connected, state.dispatchable) == STATES[state]
    assert state == state.value and f"{state}" == state.value    # travels in status as its text


# ------------------------------------------------------------------------------------------------ WorkerTable

def _ready_header(wid: str, fp: str, credit: int = 2, max_tokens: int = 100) -> dict:
    return {"id": wid, "fingerprint": fp, "credit": credit,
            "capacity": {"max_tokens": max_tokens, "max_rows": 4, "max_markers": 8}}


def test_the_worker_table_alone():
    """Registration, the model rule and the questions dispatch asks, without sockets."""
    from laya_pool.broker.table import WorkerTable
    t = WorkerTable(BrokerConfig())
    a = t.admit(b"a", _ready_header("a", "f" * 64), 10.0, 3.0)
    assert "a" not in t.workers and a.registrations == 1 and a.expiry == 13.0, "admitted, not yet in"
    t.add(a)
    assert t.pool_fp == "f" * 64 and t.of(b"a") is a, "a bare broker follows its first worker's model"
    other = t.admit(b"b", _ready_header("b", "e" * 64, max_tokens=500), 10.0, 3.0)
    t.add(other)
    assert other.state is WorkerState.MISMATCH and [w.id for w in t.serving()] == ["a"]
    assert t.capacity() == {"capacity": {"max_tokens": 100, "max_rows": 4, "max_markers": 8}}, "the pool's model's"
    assert [w.id for w in t.free()] == ["a", "b"], "a mismatched worker is free for requests that name it"
    a.inflight.update({1, 2})
    assert [w.id for w in t.free()] == ["b"], "no credit left"
    a.completed = 5
    again = t.admit(b"a", _ready_header("a", "f" * 64), 20.0, 3.0)
    t.add(again)
    assert t.of(b"a") is again and (again.completed, again.registrations, again.inflight) == (5, 2, set())
    with pytest.raises(wire.ProtocolError, match="identity"):
        t.admit(b"x", _ready_header("y", "f" * 64), 0.0, 3.0)
    with pytest.raises(wire.ProtocolError, match="max_rows"):
        t.admit(b"z", {**_ready_header("z", "f" * 64), "capacity": {"max_tokens": 1, "max_markers": 1}}, 0.0, 3.0)
    assert "z" not in t.workers and t.of(b"z") is None


# ------------------------------------------------------------------------------------------------ requeue

@pytest.fixture
def broker(tmp_path):
    b = Broker(BrokerConfig(frontend=f"ipc://{tmp_path}/fe", backend=f"ipc://{tmp_path}/be", max_attempts=3,
                            max_bounces=2))
    yield b
    b.shutdown()


# (lost?, how many times, requeued each time?)
REQUEUE = [
    (True, 1, [True]),
    (True, 3, [True, True, False]),           # the third lost attempt is the last: max_attempts 3
    (False, 3, [True, True, False]),          # two hand-backs are allowed, the third is one too many
    (False, 1, [True]),
]


@pytest.mark.parametrize("lost,times,want", REQUEUE)
def test_requeue_goes_to_the_front_until_its_chances_are_spent(broker, lost, times, want):
    behind = Job(1, "request", ("c", 1), [b"x"], 1)
    broker.dispatcher.queue.append(behind)
    job = Job(2, "request", ("c", 2), [b"y"], 2, worker="0")
    got = []
    for _ in range(times):
        ok = broker.dispatcher.requeue(job, lost=lost)
        got.append(ok)
        if ok:
            assert broker.dispatcher.queue[0] is job and job.worker is None
            broker.dispatcher.queue.popleft()
    assert got == want
    assert (job.attempts, job.bounces) == ((times, 0) if lost else (0, times))
    assert list(broker.dispatcher.queue) == [behind]


def _dealer(ctx, identity: bytes, endpoint: str):
    """A raw DEALER peer of the broker under test (a client or a worker), with `identity`."""
    import zmq
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _proved(header: dict, backend: str, identity: bytes) -> dict:
    """`header` with the proof a worker started by the pool on `backend` gives (protocol/credentials.py)."""
    return {**header, "proof": credentials.proof(credentials.read(credentials.WORKER, backend), identity)}


def _send_ready(worker, header: dict) -> None:
    """READY from `worker` (a _dealer on the backend), proved as a worker of this pool proves it."""
    import zmq
    backend = worker.getsockopt_string(zmq.LAST_ENDPOINT)
    worker.send_multipart(wire.encode(wire.Cmd.READY, _proved(header, backend, worker.getsockopt(zmq.IDENTITY))))


def _register(broker, worker, max_tokens: int) -> None:
    """`worker` (a _dealer on the backend) says READY with a credit of 1; the broker registers it and dispatches."""
    _send_ready(worker, {"id": "w0", "device": "cpu", "fingerprint": "f" * 64, "credit": 1,
                         "capacity": {"max_tokens": max_tokens, "max_rows": 4, "max_markers": 8}})
    assert broker.backend.poll(5000)
    broker._receive_all(broker.backend, broker.on_backend)


def test_a_lost_job_fails_as_workers_lost_after_max_attempts(broker, tmp_path):
    import zmq

    from laya_pool.broker.table import WorkerInfo
    ctx = zmq.Context()
    client = _dealer(ctx, b"client", f"ipc://{tmp_path}/fe")
    try:
        client.send_multipart(wire.encode(wire.Cmd.HEARTBEAT, {"rid": 1}))    # a ping: the broker learns the route
        assert broker.frontend.poll(5000)
        broker._receive_all(broker.frontend, broker.on_frontend)
        assert client.poll(5000) and wire.decode(client.recv_multipart()).header["rid"] == 1
        w = WorkerInfo(id="0", identity=b"0")
        broker.dispatcher.lost(Job(2, "request", None, [b"client"], 7, attempts=2), w, "died")
        assert not broker.dispatcher.queue and w.lost == 1 and broker.counters["requeued"] == 1
        assert client.poll(5000)
        rep = wire.parse_reply(wire.decode(client.recv_multipart()))
        assert rep.status == wire.STATUS_FINAL and rep.error["reason"] == "workers-lost" and rep.rid == 7
    finally:
        client.close(0)
        ctx.term()


def test_queued_describes_are_counted_through_dispatch_loss_and_expiry(broker, tmp_path):
    # dispatch asks "is a describe waiting?" from a counter, not a scan of the queue: the counter must
    # follow the queue through every way a describe job enters and leaves it.
    import zmq

    def counted() -> None:
        assert broker.dispatcher.describes_queued == sum(j.kind == "describe" for j in broker.dispatcher.queue)

    ctx = zmq.Context()
    w = _dealer(ctx, b"w0", f"ipc://{tmp_path}/be")
    try:
        for rid in (1, 2):
            broker.client_handlers.on_describe([b"client"], wire.decode(wire.encode(wire.Cmd.DESCRIBE, {"rid": rid})))
        broker.dispatcher.queue.append(Job(9, "request", ("c", 9), [b"client"], 9))
        counted()
        assert broker.dispatcher.describes_queued == 2
        _register(broker, w, max_tokens=100)      # the describes (not bound by its credit of 1) go, the request waits
        counted()
        d = broker.dispatcher
        assert d.describes_queued == 0 and len(d.inflight) == 2 and len(d.queue) == 1
        broker.dispatcher.worker_lost(broker.table.workers["w0"], WorkerState.DEAD, "test")   # the describes come back
        counted()
        assert broker.dispatcher.describes_queued == 2 and len(broker.dispatcher.queue) == 3
        broker.cfg.queue_timeout_s = 0.0
        broker.dispatcher.expire_queue(float("inf"))
        counted()
        assert broker.dispatcher.describes_queued == 0 and not broker.dispatcher.queue
    finally:
        w.close(0)
        ctx.term()


def _queued(rid: int, tokens: int) -> Job:
    """A request job as on_request queues it: its checked header and its untouched buffers."""
    rows = [(list(range(1, tokens + 1)), [0], 0)]
    msg = wire.decode(wire.encode_request(rid, wire.pack_rows(rows), cid="c"))
    req = wire.parse_request_head(msg, need_cid=True)
    return Job(rid, "request", ("c", rid), [b"client"], rid, req=req, payload=msg.frames)


def test_dispatch_leaves_the_jobs_it_passed_over_in_front_in_their_order(broker, tmp_path):
    # dispatch stops once no worker is free and puts back only what it passed over (the rest of a deep queue is
    # not copied per call): the order of the queue must come out as if it had been rebuilt.
    import zmq
    ctx = zmq.Context()
    w = _dealer(ctx, b"w0", f"ipc://{tmp_path}/be")
    try:
        big, too_big, small, after = _queued(1, 50), _queued(2, 60), _queued(3, 4), _queued(4, 4)
        broker.dispatcher.queue.extend([big, too_big, small, after])
        _register(broker, w, max_tokens=10)
        assert list(broker.dispatcher.queue) == [big, too_big, after], \
            "the two that fit no worker stay in front, in order"
        assert small.worker == "w0" and len(broker.dispatcher.inflight) == 1
    finally:
        w.close(0)
        ctx.term()


@pytest.mark.parametrize("reason,lost", [("drain", False), ("restart", False), ("shutdown", False), ("fatal", True)])
def test_a_worker_leaving_in_good_order_hands_back_what_was_on_its_way(broker, tmp_path, reason, lost):
    """A request dispatched to a worker's data socket can still be on its way when the worker, drained, says it is
    leaving on its control socket (two connections, no order between them): a hand-back, not a lost attempt, so a
    rolling restart never spends a request's chances. A fatal leave still counts one (the poisonous-request guard)."""
    import zmq
    ctx = zmq.Context()
    worker = _dealer(ctx, b"w0", f"ipc://{tmp_path}/be")
    try:
        _register(broker, worker, 1000)
        w = broker.table.workers["w0"]
        job = Job(5, "request", ("c", 9), [b"client"], 9, worker="w0")
        broker.dispatcher.inflight[job.id] = job
        w.inflight.add(job.id)
        worker.send_multipart(wire.encode(wire.Cmd.DISCONNECT, {"reason": reason}))
        assert broker.backend.poll(5000)
        broker._receive_all(broker.backend, broker.on_backend)
        assert (job.attempts, job.bounces) == ((1, 0) if lost else (0, 1)), (job.attempts, job.bounces)
        assert broker.dispatcher.queue[0] is job and w.lost == (1 if lost else 0) and not w.inflight
    finally:
        worker.close(0)
        ctx.term()


@pytest.mark.parametrize("how", ["handed back", "left holding it"])
def test_a_request_addressed_to_a_restarting_worker_waits_for_it_and_says_whom_it_is_for(broker, tmp_path, how):
    """A request addressed to a worker that leaves to restart, handed back by it (it came after the worker stopped
    reading) or held as it left, waits in the queue and goes to that worker when it is back, its header naming the
    worker (a draining worker runs what is addressed to it: worker/compute.py `intake`). Failing such a request at
    once would fail calls whose worker is back in seconds."""
    import zmq
    ctx = zmq.Context()
    worker = _dealer(ctx, b"w0", f"ipc://{tmp_path}/be")
    try:
        _register(broker, worker, 1000)
        w = broker.table.workers["w0"]
        addressed = _queued(11, 4)
        addressed.target = "w0"
        addressed.req.worker = "w0"
        addressed.worker = "w0"
        broker.dispatcher.inflight[addressed.id] = addressed
        w.inflight.add(addressed.id)
        worker.send_multipart(wire.encode(wire.Cmd.DRAIN, {"reason": "restart"}))
        if how == "handed back":
            worker.send_multipart(wire.encode_error(addressed.id, wire.STATUS_RETRYABLE, "worker w0 is stopping",
                                                    worker="w0", reason="stopping"))
        worker.send_multipart(wire.encode(wire.Cmd.DISCONNECT, {"reason": "restart"}))
        deadline = time.monotonic() + 5
        while w.state.value != "restarting" and time.monotonic() < deadline:
            if broker.backend.poll(100):
                broker._receive_all(broker.backend, broker.on_backend)
        assert w.state.value == "restarting" and list(broker.dispatcher.queue) == [addressed] and addressed.bounces == 1
        _register(broker, worker, 1000)                 # back: the request goes to it
        assert not broker.dispatcher.queue and addressed.worker == "w0"
        assert worker.poll(5000)
        msg = wire.decode(worker.recv_multipart())
        while msg.cmd != wire.Cmd.REQUEST:              # (what the broker says to a registering worker first)
            assert worker.poll(5000)
            msg = wire.decode(worker.recv_multipart())
        assert msg.header["rid"] == addressed.id and msg.header["worker"] == "w0"
    finally:
        worker.close(0)
        ctx.term()


# ------------------------------------------------------------------------------------------------ direct routes

def _ready(worker, wid: str, fingerprint: str, direct: str | None, key: str | None = None) -> None:
    header = {"id": wid, "device": "cpu", "fingerprint": fingerprint, "credit": 1, "host": "h1",
              "capacity": {"max_tokens": 100, "max_rows": 4, "max_markers": 8}}
    if direct is not None:
        header["direct"] = direct
    if key is not None:
        header["direct_key"] = key
    _send_ready(worker, header)


def test_routes_name_the_ready_workers_of_the_pools_model_that_take_requests_directly(broker, tmp_path):
    """The table a client asks for (`routes` in a ping's reply): ready workers of the pool's model with a direct
    endpoint; not one draining, not one of another model, not one without a direct socket; and a READY naming an
    endpoint beyond loopback without its CURVE key (`direct_key`), or a key that is not one, is refused; with its key
    the table carries it (the client authenticates the worker by it)."""
    import zmq
    ctx = zmq.Context()
    key = zmq.curve_keypair()[0].decode()
    socks = {wid: _dealer(ctx, wid.encode(), f"ipc://{tmp_path}/be") for wid in ("a", "b", "c", "d", "e", "f", "g")}
    try:
        _ready(socks["a"], "a", "f" * 64, "tcp://127.0.0.1:4001")      # first: its model becomes the pool's
        assert broker.backend.poll(5000)
        broker._receive_all(broker.backend, broker.on_backend)
        _ready(socks["b"], "b", "f" * 64, "ipc:///tmp/b.sock")
        _ready(socks["c"], "c", "f" * 64, None)
        _ready(socks["d"], "d", "e" * 64, "tcp://127.0.0.1:4004")          # another model: MISMATCH
        _ready(socks["e"], "e", "f" * 64, "tcp://10.1.2.3:4005")           # beyond loopback, no key: refused
        _ready(socks["f"], "f", "f" * 64, "tcp://10.1.2.3:4006", key)      # ... with its key: listed with it
        _ready(socks["g"], "g", "f" * 64, "tcp://10.1.2.3:4007", "x" * 39 + "~")   # not a z85 key: refused
        # Until both refusals are out, not until five workers are in: g's READY may come after f's (a slow machine).
        for _ in range(100):
            if socks["e"].poll(0) and socks["g"].poll(0):
                break
            if broker.backend.poll(100):
                broker._receive_all(broker.backend, broker.on_backend)
        assert sorted(broker.table.workers) == ["a", "b", "c", "d", "f"], sorted(broker.table.workers)
        for wid, field in (("e", "direct"), ("g", "direct_key")):
            assert socks[wid].poll(2000)
            refused = wire.decode(socks[wid].recv_multipart())
            assert refused.cmd == wire.Cmd.DISCONNECT and field in refused.header["reason"], refused.header
        # (in the order the READYs came, which ZeroMQ's fair queueing over five sockets does not fix)
        a, b, f = ["a", "tcp://127.0.0.1:4001", "h1"], ["b", "ipc:///tmp/b.sock", "h1"], \
            ["f", "tcp://10.1.2.3:4006", "h1", key]
        assert sorted(broker.table.routes()) == [a, b, f]
        broker.table.workers["a"].state = WorkerState.DRAINING
        assert sorted(broker.table.routes()) == [b, f]
        # A pool with keys (its backend admits only workers' keys) lists no direct socket without its key, even on
        # loopback: its clients would have nothing to authenticate it by.
        broker.cfg.keys = "/keys"
        header = {"id": "h", "device": "cpu", "fingerprint": "f" * 64, "credit": 1,
                  "capacity": {"max_tokens": 100, "max_rows": 4, "max_markers": 8}, "direct": "tcp://127.0.0.1:4008"}
        header = _proved(header, broker.cfg.backend, b"h")
        with pytest.raises(wire.ProtocolError, match="direct_key"):
            broker.worker_handlers.on_ready(b"h", wire.decode(wire.encode(wire.Cmd.READY, header)), 0.0)
        keyed = {**header, "direct_key": key}
        broker.worker_handlers.on_ready(b"h", wire.decode(wire.encode(wire.Cmd.READY, keyed)), 0.0)
        assert broker.table.routes()[-1] == ["h", "tcp://127.0.0.1:4008", "?", key]
        assert broker.status()["workers"][1]["direct"] == "ipc:///tmp/b.sock"
    finally:
        for s in socks.values():
            s.close(0)
        ctx.term()


def test_a_laya2_worker_is_told_why_in_its_own_layout(broker, tmp_path):
    """A worker of the protocol before this one (version, command and header as three frames) registering: its
    DISCONNECT comes in that layout, its reason naming the version, so the old worker logs why it may not join
    (before, it got the LAYA3 layout and could only say that the framing was wrong)."""
    import msgpack
    import zmq
    ctx = zmq.Context()
    worker = _dealer(ctx, b"w2", f"ipc://{tmp_path}/be")
    try:
        worker.send_multipart([wire.LAYA2, bytes([wire.Cmd.READY]), msgpack.packb({"id": "w2"})])
        assert broker.backend.poll(5000)
        broker._receive_all(broker.backend, broker.on_backend)
        assert worker.poll(5000), "no answer for a LAYA2 READY"
        frames = worker.recv_multipart()
    finally:
        worker.close(0)
        ctx.term()
    assert frames[:2] == [wire.LAYA2, bytes([wire.Cmd.DISCONNECT])], frames
    reason = msgpack.unpackb(frames[2])["reason"]
    assert "version" in reason and "LAYA3" in reason, reason
    assert "w2" not in broker.table.workers
