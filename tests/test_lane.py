"""Lanes (protocol/lane.py, worker/lanes.py): real shared memory between two mappings, the checks a worker makes
before it maps a client's lane, and a live pool whose clients send on lanes (results, bad input, kill -9)."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from conftest import make_rows, reference_logits, wait_until

from laya_pool.client.local import local_pool
from laya_pool.client.pool import Client
from laya_pool.protocol import lane as ln
from laya_pool.protocol import wire
from laya_pool.protocol.lane import Lane, pack_frames, unpack_frames
from laya_pool.worker.lanes import IDLE_S, Full, Lanes

pytestmark = pytest.mark.skipif(not ln.supported(), reason="lanes need x86-64 Linux and /dev/shm")


@pytest.fixture
def pair():
    """A client's lane and the worker's mapping of it (the name unlinked, as once a worker has it)."""
    client = Lane.create()
    worker = Lane.open(client.name, client.secret())
    assert not os.path.exists(os.path.join(ln.DIRECTORY, client.name))      # the worker unlinked it
    yield client, worker
    worker.close()
    client.close()


def test_frames_go_through_an_area_whole_and_what_does_not_fit_is_refused():
    area = memoryview(bytearray(256))
    frames = [b"LAYA", b"\x02", np.arange(5, dtype=np.int32), memoryview(b"tail")]
    size = pack_frames(frames, area)
    assert unpack_frames(area, size) == [b"LAYA", b"\x02", np.arange(5, dtype=np.int32).tobytes(), b"tail"]
    assert pack_frames([b"x" * 300], area) is None
    assert pack_frames([b""] * (ln.MAX_FRAMES + 1), area) is None


@pytest.mark.parametrize("size, count, why", [(2, 1, "a message of 2 bytes"), (8, 0, "0 frames"), (8, 3, "lengths run"),
                                              (20, 1, "frames of 4 bytes in a message of 12")])
def test_a_broken_area_is_a_protocol_error_naming_the_lane(size, count, why):
    area = memoryview(bytearray(64))
    area[:4] = count.to_bytes(4, "little")
    area[4:8] = (4).to_bytes(4, "little")           # the first frame's length
    with pytest.raises(wire.ProtocolError) as e:
        unpack_frames(area, size)
    assert e.value.field == "lane" and why in e.value.message


def test_a_request_and_its_answer_cross_the_lane(pair):
    client, worker = pair
    assert client.free() and worker.asked() is None and client.answer() is None
    frames = wire.encode(wire.Cmd.HEARTBEAT, {"rid": 1})
    assert client.ask(frames) == 1
    assert not client.free()
    assert worker.asked() == [bytes(f) for f in frames]
    assert worker.asked() is None                      # taken once
    assert client.answer() is None                     # not answered yet
    worker.reply([b"answer", b"two"])
    assert client.free() and client.answer() == [b"answer", b"two"]
    client.ask([b"next"])
    worker.asked()
    assert worker.reply([b"z" * (ln.AREA_BYTES + 1)]) is False and not client.free()   # too large: the socket's
    worker.reply(None)
    assert client.free() and client.answer() == []


def test_the_flags_are_seen_across_the_mappings(pair):
    client, worker = pair
    assert not client.usable() and not worker.closed() and not worker.wants_ring()
    worker.set_awake(True)
    client.ring_me(True)
    assert client.usable() and worker.wants_ring()
    client.ask([b"x"])
    assert not client.usable()                         # one request at a time
    worker.asked()
    worker.leave()                                     # the worker closes it: the client is told
    assert client.gone() and not client.worker_awake() and client.answer() is None


def test_a_retried_or_abandoned_request_stops_the_wait_on_its_lane(pair):
    import zmq

    from laya_pool.client.direct import Route, Routes
    client, worker = pair
    routes = Routes(zmq.Context.instance(), None, 1 << 20, host="here", lanes=True)
    r = Route("w", "tcp://127.0.0.1:1", lane=client, lane_open=True, connected=True)
    routes.routes["w"] = r
    worker.set_awake(True)
    for leave in (lambda: routes.detach(1), lambda: routes.answered(2)):
        rid = 1 if not routes.on_lanes else 2
        assert routes.send(rid, [b"q"]) and routes.waiting == [r]
        leave()
        assert routes.waiting == [] and r.lane_rid is None
        assert not client.usable()                     # until the worker's late answer comes
        worker.asked()
        worker.reply([b"late"])
        assert client.usable()


def test_stale_lane_files_are_swept():
    old, new = Lane.create(), Lane.create()
    try:
        os.utime(os.path.join(ln.DIRECTORY, old.name), (time.time() - 120, time.time() - 120))
        assert ln.sweep(60.0) >= 1
        assert not os.path.exists(os.path.join(ln.DIRECTORY, old.name))
        assert os.path.exists(os.path.join(ln.DIRECTORY, new.name))
    finally:
        for x in (old, new):
            x.unlink()
            x.close()


def test_a_client_asleep_on_its_lane_wakes_when_the_worker_answers(pair):
    """The futex (protocol/lane.py `sleep`, woken in `reply`): asleep for up to 2 s, awake as soon as the answer is
    written (another thread plays the worker); without an answer, back after its timeout."""
    import threading
    client, worker = pair
    client.ask([b"q"])
    t0 = time.monotonic()
    client.sleep(0.05)                                 # nobody answers: the timeout
    assert 0.04 <= time.monotonic() - t0 < 1.0 and not client.free()
    answer = threading.Timer(0.05, lambda: (worker.asked(), worker.reply([b"a"])))
    answer.start()
    t0 = time.monotonic()
    client.sleep(2.0)
    took = time.monotonic() - t0
    answer.join()
    assert client.free() and client.answer() == [b"a"] and 0.04 <= took < 1.0, took
    t0 = time.monotonic()
    assert client.sleep(2.0)                           # answered already: back at once
    assert time.monotonic() - t0 < 0.1
    client.ask([b"q2"])
    worker.asked()
    closing = threading.Timer(0.05, worker.leave)      # closing the lane wakes the sleeper too
    closing.start()
    t0 = time.monotonic()
    client.sleep(2.0)
    closing.join()
    assert client.gone() and time.monotonic() - t0 < 1.0


def test_a_client_that_leaves_says_so(pair):
    client, worker = pair
    client.close(say=True)
    assert worker.closed() and worker.mapped()


def test_a_worker_maps_only_a_private_lane_of_its_own_user_named_with_its_secret():
    for name in ("../etc/passwd", "laya-lane-XYZ", 7, None):
        with pytest.raises(wire.ProtocolError, match="not a lane's name"):
            Lane.open(name, "")
    with pytest.raises(wire.ProtocolError, match="cannot open"):
        Lane.open("laya-lane-0123456789abcdef", "")
    lane = Lane.create()
    path = os.path.join(ln.DIRECTORY, lane.name)
    secret = lane.secret()
    try:
        os.chmod(path, 0o644)
        with pytest.raises(wire.ProtocolError, match="others may read"):
            Lane.open(lane.name, secret)
        os.chmod(path, 0o600)
        os.truncate(path, ln.SIZE + 8)
        with pytest.raises(wire.ProtocolError, match="its size"):
            Lane.open(lane.name, secret)
        os.truncate(path, ln.SIZE)
        lane.words[ln.MAGIC_WORD] = 0
        with pytest.raises(wire.ProtocolError, match="magic"):
            Lane.open(lane.name, secret)
        lane.words[ln.MAGIC_WORD] = ln.MAGIC
        for wrong in ("00" * ln.SECRET_BYTES, secret[:-2], None, "\u00e9" * 32):    # someone who only saw the name
            with pytest.raises(wire.ProtocolError, match="secret"):
                Lane.open(lane.name, wrong)
        Lane.open(lane.name, secret).close()           # and the good one opens
        assert not os.path.exists(path)
    finally:
        lane.unlink()
        lane.close()
    os.mkfifo(path, 0o600)
    try:
        with pytest.raises(wire.ProtocolError, match="not a regular file"):
            Lane.open(lane.name, secret)
    finally:
        os.unlink(path)


def test_the_worker_s_lanes_take_requests_close_what_clients_left_and_stay_bounded():
    lanes = Lanes(limit=2)
    made = [Lane.create() for _ in range(4)]
    try:
        a, b, c, d = made
        lanes.attach(a.name, a.secret(), b"A")
        with pytest.raises(wire.ProtocolError, match="open already"):
            lanes.attach(a.name, a.secret(), b"X")    # nobody takes a lane over
        lanes.attach(b.name, b.secret(), b"B")
        lanes.set_awake(True)
        assert a.worker_awake() and b.worker_awake()
        assert lanes.take() is None
        b.ask([b"from b"])
        lane, frames = lanes.take()
        assert (lane.identity, frames, lanes.taken) == (b"B", [b"from b"], 1)
        with pytest.raises(Full):                      # full, and nothing idle for IDLE_S yet
            lanes.attach(c.name, c.secret(), b"C")
        assert sorted(lanes.open) == sorted([a.name, b.name]) and lanes.refused == 1 and not a.gone()
        for x in lanes.open.values():
            x.used -= IDLE_S                           # both quiet that long, but neither is empty:
        a.ask([b"from a"])                             # a's request written, not taken yet
        with pytest.raises(Full):                      # and b's taken, not answered (a forward running)
            lanes.attach(c.name, c.secret(), b"C")
        assert lanes.refused == 2 and not a.gone() and not b.gone()
        worker_b = lanes.open[b.name]
        worker_b.reply([b"answer"])
        lanes.answered(worker_b)
        assert b.answer() == [b"answer"]
        with pytest.raises(Full):                      # b is empty now, but was in use a moment ago
            lanes.attach(c.name, c.secret(), b"C")
        worker_b.used -= IDLE_S
        lanes.attach(c.name, c.secret(), b"C")         # b idle and empty: it goes, and says so; a keeps its request
        assert sorted(lanes.open) == sorted([a.name, c.name]) and lanes.evicted == 1
        assert b.gone() and not b.worker_awake() and not a.gone()
        assert c.worker_awake()                       # a new lane learns the state at once
        lane, frames = lanes.take()
        assert (lane.identity, frames) == (b"A", [b"from a"])
        c.close(say=True)                             # c's client left: its place is free for d at once
        lanes.attach(d.name, d.secret(), b"D")
        assert sorted(lanes.open) == sorted([a.name, d.name]) and lanes.evicted == 1
        d.ask([b"broken"])
        d.request[:4] = (99).to_bytes(4, "little")   # a count no lane message has
        lane, err = lanes.take()
        assert lane.identity == b"D" and isinstance(err, wire.ProtocolError) and err.field == "lane"
        a.close(say=True)
        assert lanes.take() is None and list(lanes.open) == [d.name]
        lanes.forget(b"D")
        assert len(lanes) == 0 and d.gone()
    finally:
        lanes.close()
        for x in made:
            x.unlink()
            x.close()


def test_the_inbox_refuses_a_lane_it_has_no_room_for_as_busy_and_keeps_serving():
    """worker/inbox.py: a LANE beyond the worker's room is answered retryable (busy), on a live inbox whose data
    thread goes on taking lanes and requests."""
    import zmq

    from laya_pool.worker.inbox import SocketInbox
    ctx = zmq.Context()
    inbox = SocketInbox(ctx, "tcp://127.0.0.1:1", "w1", max_message_bytes=1 << 22, direct="tcp://127.0.0.1:*",
                        lanes=True)
    inbox.lanes.limit = 1
    stop = threading.Event()

    def data_thread():
        inbox.open()
        while not stop.is_set():
            inbox.get(0.05)
        inbox.close()
    t = threading.Thread(target=data_thread, daemon=True)
    t.start()
    made, socks = [Lane.create() for _ in range(3)], []
    try:
        said = []
        for lane in made:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(inbox.direct_endpoint)
            socks.append(s)
            s.send_multipart(wire.encode(wire.Cmd.LANE, {"rid": ln.lane_rid(lane.name), "lane": lane.name,
                                                          "secret": lane.secret()}))
            assert s.poll(5000)
            said.append(wire.decode(s.recv_multipart()).header)
        assert said[0]["status"] == "ok"
        for h in said[1:]:
            assert h["status"] == "retryable" and h["error"]["reason"] == "busy" and h["error"]["field"] == "lane", h
        assert t.is_alive() and inbox.lanes.refused == 2
    finally:
        stop.set()
        t.join(5)
        for s in socks:
            s.close(0)
        for lane in made:
            lane.unlink()
            lane.close()
        ctx.destroy(0)               # (the inbox's wake-up socket is the I/O thread's to close)


def test_a_lane_refused_for_want_of_room_is_asked_for_again_and_one_refused_for_good_is_not():
    import zmq

    from laya_pool.client.direct import Route, Routes
    from laya_pool.protocol.lane import lane_rid
    routes = Routes(zmq.Context.instance(), None, 1 << 20, host="here", lanes=True)
    for status, asks_again in ((wire.STATUS_RETRYABLE, True), (wire.STATUS_FINAL, False)):
        r = Route("w", "tcp://127.0.0.1:1", lane=Lane.create(), connected=True)
        routes.routes["w"] = r
        routes.replied({"rid": lane_rid(r.lane.name), "status": status})
        assert r.lane is None and r.lane_refused is not asks_again and routes._wants_lane(r) is asks_again


def test_a_worker_that_fell_asleep_as_the_request_was_written_is_rung_on_the_socket():
    """`Routes.send` finds the worker polling, writes, then sees it asleep (protocol/lane.py: AWAKE is not exact):
    the request stays on the lane and a LANE ring goes on the route's socket to wake the worker."""
    import zmq

    from laya_pool.client.direct import Route, Routes
    ctx = zmq.Context()
    worker_sock = ctx.socket(zmq.ROUTER)
    worker_sock.bind("tcp://127.0.0.1:*")
    sock = ctx.socket(zmq.DEALER)
    sock.connect(worker_sock.getsockopt_string(zmq.LAST_ENDPOINT))
    routes = Routes(ctx, None, 1 << 20, host="here", lanes=True)
    mine = Lane.create()
    r = Route("w", "tcp://127.0.0.1:1", sock=sock, lane=mine, lane_open=True, connected=True)
    routes.routes["w"] = r
    theirs = Lane.open(mine.name, mine.secret())
    try:
        theirs.set_awake(True)
        looks = iter([True, False])                   # awake when checked, asleep right after the write
        mine.worker_awake = lambda: next(looks)
        assert routes.send(9, [b"req"]) and routes.waiting == [r] and theirs.asked() == [b"req"]
        assert worker_sock.poll(5000)
        rung = wire.decode(worker_sock.recv_multipart()[1:])
        assert rung.cmd == wire.Cmd.LANE and rung.header == {"rid": ln.lane_rid(mine.name), "ring": True}
    finally:
        theirs.close()
        mine.unlink()
        ctx.destroy(0)


def test_a_request_on_a_lane_its_worker_closed_is_lost_and_resent():
    """client/direct.py's side of GONE: the request comes back from `take_lost` (the client re-sends it through the
    broker at once) and the route asks for a lane again with the next table."""
    import zmq

    from laya_pool.client.direct import Route, Routes
    routes = Routes(zmq.Context.instance(), None, 1 << 20, host="here", lanes=True)
    mine = Lane.create()
    sock = routes.ctx.socket(zmq.DEALER)             # connected to nobody: a send that misses the lane is refused
    r = Route("w", "tcp://127.0.0.1:1", sock=sock, lane=mine, lane_open=True, connected=True)
    routes.routes["w"] = r
    theirs = Lane.open(mine.name, mine.secret())
    try:
        assert routes.send(5, [b"req"]) is False       # the worker does not poll its lanes: the socket's (refused)
        theirs.set_awake(True)
        assert routes.send(5, [b"req"]) and routes.on_lanes == 1 and routes.waiting == [r]
        assert theirs.asked() == [b"req"]
        assert not routes.lane_ready()
        theirs.leave()
        assert routes.lane_ready() and routes.answers() == []
        assert routes.take_lost() == [5] and routes.take_lost() == [] and routes.dropped == 1
        assert r.lane is None and not r.lane_refused and routes.waiting == [] and 5 not in r.inflight
    finally:
        sock.close(0)
        mine.unlink()


# -- a live pool --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lane_pool(tiny_ckpt, tmp_path_factory):
    """Two CPU workers taking requests on their data threads, directly and on lanes; each polls 0.2 s after a reply
    (a CUDA worker's 2 ms is shorter than a CPU forward), so a closed loop's next request finds it awake."""
    log = tmp_path_factory.mktemp("lanes") / "pool.log"
    env = {"LAYA_DATA_REQUESTS": "on", "LAYA_DIRECT": "on", "LAYA_LANES": "on", "LAYA_WORKER_POLL_US": "200000"}
    with local_pool(tiny_ckpt, "cpu", workers_per_device=2, log=log, env=env, startup_timeout=180) as pool:
        yield pool
    text = log.read_text()
    assert pool.process.returncode == 0 and "Traceback" not in text, text[-3000:]


async def _lanes_open_async(c) -> None:
    """An AsyncClient's wait for both workers' lanes (asked for with the table its first call fetched)."""
    import asyncio
    for _ in range(600):
        if len(c._routes.routes) == 2 and all(r.lane_open for r in c._routes.routes.values()):
            return
        await c.ping()            # the table again, and the workers' answers to the lane requests
        await asyncio.sleep(0.05)


def _lanes_open(c: Client) -> bool:
    c.ping()                  # the table, and the lanes' answers read by the client's poll
    return len(c._routes.routes) == 2 and all(r.lane_open for r in c._routes.routes.values())


def test_a_closed_loop_goes_on_lanes_with_the_same_answers(lane_pool, tiny_runtime):
    rows = make_rows(11)
    want = reference_logits(tiny_runtime, rows)
    for spin_ms in (None, 0):         # polling for the answer, and sleeping until the worker rings
        with Client(lane_pool.endpoint, timeout=30, spin_ms=spin_ms) as c:
            c.forward(rows)
            wait_until(lambda c=c: _lanes_open(c), 30, "the lanes never opened")
            for _ in range(12):
                np.testing.assert_allclose(c.forward(rows).flat, want, rtol=1e-5, atol=1e-5)
            assert c._routes.on_lanes >= 8, (spin_ms, c._routes.on_lanes, c._routes.sent)

    def counted():
        ws = lane_pool.status()["workers"]
        return sum(w.get("stats", {}).get("lanes", 0) for w in ws) >= 8
    wait_until(counted, 30, "the workers never counted their lanes' requests")
    def timed():                                   # every ok answer timed by its worker, lanes' included (a
        stats = [w["stats"] for w in lane_pool.status()["workers"]]     # heartbeat's snapshot, once the pool is idle)
        return all(sum(s.get("answer_seconds", {}).get("counts", [])) == s.get("ok") > 0
                   and s["answer_seconds"]["sum"] > 0 for s in stats)
    wait_until(timed, 30, lambda: f"answer_seconds does not count the answers: {lane_pool.status()['workers']}")


def test_a_bad_message_on_a_lane_is_refused_naming_the_field_and_the_worker_keeps_serving(lane_pool, tiny_runtime):
    rows = make_rows(12)
    with Client(lane_pool.endpoint, timeout=30) as c:
        c.forward(rows)
        wait_until(lambda: _lanes_open(c), 30, "the lanes never opened")
        r = next(iter(c._routes.routes.values()))
        wait_until(r.lane.worker_awake, 30, "the worker never polled its lanes")
        for frames, field in (([b"LAYA9", b"\x02", b"\x80"], "version"),
                              (wire.encode_request(5, wire.pack_rows(rows)), "cid")):
            r.lane.ask(frames)
            wait_until(r.lane.free, 30, "no answer on the lane")
            err = wire.decode(r.lane.answer())
            assert err.header["status"] == "final" and err.header["error"]["field"] == field, err.header
        np.testing.assert_allclose(c.forward(rows).flat, reference_logits(tiny_runtime, rows), rtol=1e-5, atol=1e-5)


def test_kill_9_of_a_worker_answering_on_a_lane(lane_pool, tiny_runtime):
    """The lane's request is lost with its worker: the route's connection drops and the call goes again through the
    broker, at once, to the other worker; the right answer, nothing lost."""
    rows = make_rows(13, 16, 256)
    want = reference_logits(tiny_runtime, rows)
    pids = {w["id"]: w["pid"] for w in lane_pool.status()["workers"]}
    with Client(lane_pool.endpoint, timeout=60, retries=6) as c:
        c.forward(make_rows(14))
        wait_until(lambda: _lanes_open(c), 30, "the lanes never opened")
        routes = c._routes
        for _ in range(20):       # until a call is on a lane when the kill comes
            got: dict = {}
            call = threading.Thread(target=lambda got=got: got.setdefault("r", c.forward(rows)))
            call.start()
            deadline = time.monotonic() + 30
            on_lane: list = []
            while not on_lane and call.is_alive() and time.monotonic() < deadline:
                on_lane = list(routes.waiting)        # (the call's thread changes it)
                time.sleep(0.0005)
            if on_lane:
                os.kill(pids[on_lane[0].worker], signal.SIGKILL)
                killed = time.monotonic()
                break
            call.join(60)
        else:
            pytest.fail("no call went on a lane")
        call.join(60)
        # At once: not after the attempt's share of the deadline (60 s over 7 attempts)
        assert time.monotonic() - killed < 5.0
        np.testing.assert_allclose(got["r"].flat, want, rtol=1e-5, atol=1e-5)
        assert c._routes.dropped >= 1
    wait_until(lambda: sum(w["state"] == "ready" for w in lane_pool.status()["workers"]) == 2, 90,
               "the killed worker never came back")


def test_several_calls_out_on_lanes_and_sockets_at_once(lane_pool):
    """Client._run_all (predict_batch, one state a request): lanes and sockets carry calls together, and a client
    asleep on its sockets is rung by the worker that answered on a lane (RING); the same answers as one at a time."""
    from conftest import assert_answers_close
    states = [f"ticket {i}: the printer on floor {i} is broken" for i in range(8)]
    questions = {"team": {"type": "choice", "instructions": "Which team handles this ticket?",
                          "criteria": {"it": "hardware", "hr": "people", "sales": "deals"}}}
    with Client(lane_pool.endpoint, timeout=30, spin_ms=0) as c:
        want = [c.predict(s, questions) for s in states]
        wait_until(lambda: _lanes_open(c), 30, "the lanes never opened")
        before = c._routes.on_lanes
        for _ in range(3):
            t0 = time.monotonic()
            got = c.predict_batch(states, questions, batch_size=1)
            assert time.monotonic() - t0 < 10
            for g, w in zip(got, want, strict=True):
                assert_answers_close(g, w)
        assert c._routes.on_lanes > before, (before, c._routes.on_lanes)


def test_an_asyncio_client_s_lone_call_goes_on_the_socket_and_calls_out_together_on_lanes(lane_pool, tiny_runtime):
    """AsyncClient: a call with no other call of the client out goes on the route's socket, not on its lane (the event
    loop cannot wait on a lane, so the answer would come as a ring on that socket and then a read of the lane: more
    than the answer on the socket costs); calls out together go on lanes, every answer there rung on the route's
    socket. The same answers either way. Counted by the client (attempts on lanes, direct attempts) and by the
    workers (requests read from lanes), not timed."""
    import asyncio

    from laya_pool.client.pool_async import AsyncClient
    rows = make_rows(15)
    want = reference_logits(tiny_runtime, rows)

    def lanes_read() -> int:
        return sum(w.get("stats", {}).get("lanes", 0) for w in lane_pool.status()["workers"])

    async def main() -> tuple[int, int, int, int]:
        async with AsyncClient(lane_pool.endpoint, timeout=30) as c:
            routes = c._routes
            await c.forward(rows)
            await _lanes_open_async(c)
            assert all(r.lane is not None and r.lane.words[ln.RING] == 1 for r in routes.routes.values())
            on_lanes, sent = routes.on_lanes, routes.sent
            for _ in range(10):           # one at a time: each the only call out
                np.testing.assert_allclose((await c.forward(rows)).flat, want, rtol=1e-5, atol=1e-5)
            lone_lanes, lone_direct = routes.on_lanes - on_lanes, routes.sent - sent
            on_lanes = routes.on_lanes
            for _ in range(20):           # until a round finds a worker polling its lanes (0.2 s after a reply)
                t0 = time.monotonic()
                got = await asyncio.gather(*(c.forward(rows) for _ in range(16)))
                assert time.monotonic() - t0 < 5            # rung, not found by an attempt's timeout
                for g in got:
                    np.testing.assert_allclose(g.flat, want, rtol=1e-5, atol=1e-5)
                if routes.on_lanes > on_lanes:
                    break
            return lone_lanes, lone_direct, routes.on_lanes - on_lanes, len(routes.waiting)
    before = lanes_read()
    lone_lanes, lone_direct, together, waiting = asyncio.run(main())
    assert (lone_lanes, lone_direct) == (0, 10), f"lone calls: {lone_lanes} on lanes, {lone_direct} direct of 10"
    assert together >= 1 and waiting == 0, (together, waiting)
    wait_until(lambda: lanes_read() >= before + together, 30, "the workers never counted the requests on their lanes")


def test_requests_on_lanes_are_read_while_the_sockets_stay_busy(lane_pool, tiny_runtime):
    """An asyncio client keeps 16 calls out for two seconds: one at a time on each worker's lane, the rest on the
    sockets, which so always hold a request. The data thread must keep reading the lanes (it read the sockets first, so
    a lane's request waited for its attempt's timeout, then went again through the broker). Counted, and timed only
    against that timeout (6 s: 30 s over retries + 2 attempts)."""
    import asyncio

    from laya_pool.client.pool_async import AsyncClient
    rows = make_rows(9)
    want = reference_logits(tiny_runtime, rows)

    async def main() -> tuple[int, float, int]:
        async with AsyncClient(lane_pool.endpoint, timeout=30) as c:
            routes = c._routes
            await c.forward(rows)
            await _lanes_open_async(c)
            on_lanes, slowest, stop = routes.on_lanes, 0.0, time.monotonic() + 2.0

            async def loop() -> None:
                nonlocal slowest
                while time.monotonic() < stop:
                    t0 = time.monotonic()
                    got = await c.forward(rows)
                    slowest = max(slowest, time.monotonic() - t0)
                    np.testing.assert_allclose(got.flat, want, rtol=1e-5, atol=1e-5)
                    assert got.attempts == 1
            await asyncio.gather(*(loop() for _ in range(16)))
            return routes.on_lanes - on_lanes, slowest, len(routes.waiting)
    on_lanes, slowest, waiting = asyncio.run(main())
    # This CPU: ~400 on lanes and 0.09 s at most; reading the sockets first, 2 and 2.0 s.
    assert on_lanes >= 100, f"only {on_lanes} requests went on the lanes in 2 s"
    assert slowest < 3.0 and waiting == 0, (slowest, waiting)          # a stuck lane waits its attempt's 6 s


def test_a_round_trips_parts_are_in_order_on_one_clock(lane_pool):
    """benchmarks/round_trip.py's split of a lane call: the client's two stamps and the worker's two, all on
    `time.monotonic`, fall in the order the call meets them (the parts are differences of consecutive stamps, so
    their sum is the total by construction; their order is what is checked). A stamp in the wrong place breaks the
    order: stamping "seen" when a spin ran out unanswered makes notice < 0, and this test fails on it."""
    from benchmarks import round_trip as rt
    rows = make_rows(1)
    marks: dict[str, float] = {}
    send = rt.direct.Routes.send
    with rt.hooked(marks), Client(lane_pool.endpoint, timeout=30, spin_ms=100) as c:     # (spins past a CPU forward)
        c.forward(rows)
        wait_until(lambda: _lanes_open(c), 30, "the lanes never opened")
        parts = [p for p in (rt.timed_call(c, rows, marks) for _ in range(30)) if p[1] is not None]
    assert rt.direct.Routes.send is send                 # the hooks are gone
    assert len(parts) >= 10, len(parts)                  # most calls went on a lane (its worker awake)
    for _, split, _ in parts:
        assert all(v >= 0 for v in split.values()), split
