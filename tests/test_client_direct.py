"""client/direct.py: the choice of worker, the broker's table, and the direct sockets' life (real ZeroMQ sockets;
the pool-level behaviour, kill -9 included, is in tests/test_pool.py)."""
from __future__ import annotations

import zmq
from conftest import wait_until

from laya_pool.client.direct import Route, Routes, Target, pick, usable
from laya_pool.protocol import wire


def _route(worker: str, outstanding: int, up: bool = True) -> Route:
    return Route(worker, f"tcp://127.0.0.1:{1000 + int(worker)}", inflight=dict.fromkeys(range(outstanding), 0.0),
                 up=up, connected=True)


def test_pick_takes_the_least_outstanding_usable_route_and_turns_on_ties():
    rs = [_route("0", 2), _route("1", 1), _route("2", 1), _route("3", 0, up=False)]
    assert pick(rs, 0).worker == "1"
    assert pick(rs, 2).worker == "2"            # a tie goes to the first from the turn on
    assert pick([_route("0", 0, up=False)], 0) is None
    unconnected = _route("0", 0)
    unconnected.connected = False             # its handshake not done yet: the attempt goes to the broker
    assert pick([unconnected, _route("1", 5)], 0).worker == "1"
    assert pick([], 0) is None


def test_the_table_keeps_only_loopback_routes_on_this_host():
    table = [["0", "tcp://127.0.0.1:5000", "here"], ["1", "tcp://10.0.0.7:5000", "here"],
             ["2", "tcp://127.0.0.1:5001", "elsewhere"], ["3", "ipc:///tmp/w3", "here", ""], ["4", 5, "here"], "junk"]
    assert usable(table, "here") == {"0": Target("tcp://127.0.0.1:5000", "", True),
                                     "3": Target("ipc:///tmp/w3", "", True)}
    assert usable(None, "here") == {} and usable({"0": "x"}, "here") == {}


def test_with_keys_a_route_is_usable_from_any_host_by_its_key():
    """A pool with keys: each worker's direct socket is a CURVE server whose key the table carries; a client with
    keys takes any tcp route (it authenticates the worker by that key), an ipc one only on its own host, and a
    client without keys none of them (it could not connect)."""
    key = zmq.curve_keypair()[0].decode()
    table = [["0", "tcp://10.0.0.7:5000", "there", key], ["1", "tcp://127.0.0.1:5001", "here", key],
             ["2", "ipc:///tmp/w2", "there", key], ["3", "ipc:///tmp/w3", "here", key],
             ["4", "tcp://10.0.0.7:5002", "there", "not a key"], ["5", "tcp://10.0.0.7:5003", "there", key[:-1]],
             ["6", "tcp://127.0.0.1:5004", "there", key], ["7", "tcp://0.0.0.0:5005", "there", key],
             ["8", "tcp://*:5006", "there", key]]        # another host's loopback or wildcard: not reachable from here
    assert usable(table, "here", curve=True) == {"0": Target("tcp://10.0.0.7:5000", key, False),
                                                 "1": Target("tcp://127.0.0.1:5001", key, True),
                                                 "3": Target("ipc:///tmp/w3", key, True)}
    assert usable(table, "here") == {}


def _connected(routes, worker: str) -> bool:
    """Read the route's monitor (what the client's poll does) until its handshake is done."""
    r = routes.routes[worker]
    routes.events(r.mon)
    return r.connected


def _worker_socket(ctx):
    s = ctx.socket(zmq.ROUTER)
    s.bind("tcp://127.0.0.1:*")
    return s, s.getsockopt_string(zmq.LAST_ENDPOINT)


def test_routes_send_to_a_worker_and_resend_what_a_dropped_connection_held():
    ctx = zmq.Context()
    poller = zmq.Poller()
    routes = Routes(ctx, poller, 1 << 20, host="here")
    worker, endpoint = _worker_socket(ctx)
    try:
        routes.asked([["w", endpoint, "here"]], now=0.0)
        assert list(routes.routes) == ["w"] and routes.due(1.0) is False
        frames = wire.encode(wire.Cmd.HEARTBEAT, {"rid": 7})
        # Sent only once the connection is made: before, the attempt goes to the broker.
        assert routes.send(7, frames) is False
        wait_until(lambda: _connected(routes, "w"), 5, "the route never connected")
        assert routes.send(7, frames)
        assert worker.poll(5000)
        got = worker.recv_multipart()
        assert wire.decode(got[1:]).header["rid"] == 7 and routes.by_rid[7].worker == "w"
        # The worker dies with request 7 on it: its monitor says so, and 7 is handed back to be sent again.
        worker.close(0)
        lost: list[int] = []

        def dropped():
            ready = dict(poller.poll(100))
            for s in ready:
                if s is routes.routes["w"].mon:
                    lost.extend(routes.events(s))
            return lost
        wait_until(dropped, 10, "the dropped connection was never seen")
        assert lost == [7] and routes.dropped == 1 and routes.routes["w"].up is False
        assert routes.choose() is None                     # nothing usable until the table says so
        routes.asked([], now=10.0)                          # the worker is gone from the table: its socket closes
        assert routes.routes == {} and routes.by_socket == {}
    finally:
        routes.close()
        ctx.destroy(0)


def test_a_worker_that_says_it_is_stopping_is_sent_nothing_more():
    ctx = zmq.Context()
    routes = Routes(ctx, zmq.Poller(), 1 << 20, host="here")
    worker, endpoint = _worker_socket(ctx)
    try:
        routes.asked([["w", endpoint, "here"]], now=0.0)
        frames = wire.encode(wire.Cmd.HEARTBEAT, {"rid": 1})
        wait_until(lambda: _connected(routes, "w"), 5, "the route never connected")
        assert routes.send(1, frames)
        routes.answered(1, wire.STATUS_OK)
        assert routes.routes["w"].up and not routes.routes["w"].inflight
        assert routes.send(2, frames)
        routes.answered(2, wire.STATUS_RETRYABLE, "stopping")
        assert routes.routes["w"].up is False and routes.send(3, frames) is False
        routes.asked([["w", endpoint, "here"]], now=1.0)    # listed as ready again (a restarted drain)
        assert routes.routes["w"].up
        # A retry through the broker detaches the direct attempt; one that heard nothing blames its worker.
        assert routes.send(4, frames) and routes.send(5, frames)
        routes.detach(4)
        assert routes.routes["w"].up and set(routes.routes["w"].inflight) == {5}
        routes.detach(5, blame=True)
        assert routes.routes["w"].up is False and not routes.routes["w"].inflight and not routes.by_rid
        # ... unless a message came from its worker after this attempt went out: alive, the attempt only queued there
        routes.asked([["w", endpoint, "here"]], now=2.0)
        r = routes.routes["w"]
        assert routes.send(6, frames) and routes.send(7, frames)
        routes.heard_from(r)                       # (what the clients' readers call for each message on the route)
        routes.answered(6, wire.STATUS_OK)
        routes.detach(7, blame=True)
        assert r.up and not r.inflight and routes.send(8, frames)
        assert routes.send(9, frames)
        routes.answered(8)                         # a call that ended with no reply (gave up): heard nothing
        routes.detach(9, blame=True)               # nothing came since 9 went out: blamed
        assert r.up is False
    finally:
        routes.close()
        ctx.destroy(0)


def test_a_reply_that_came_before_its_worker_left_counts():
    """A worker answers its last request and leaves (a drain, a restart): the client must take that answer, not
    re-send the request because the connection dropped in the same poll. The broker here answers only the table
    question (a bare socket: no pool can time a reply and a disconnect into one poll), so a re-send would time out."""
    import socket
    import threading
    import time

    from laya_pool.client.pool import Client

    ctx = zmq.Context()
    broker, broker_ep = _worker_socket(ctx)
    worker, worker_ep = _worker_socket(ctx)
    stop = threading.Event()

    def serve_table():
        while not stop.is_set():
            if broker.poll(20):
                ident, *frames = broker.recv_multipart()
                m = wire.decode(frames)
                if m.cmd == wire.Cmd.HEARTBEAT:
                    broker.send_multipart([ident, *wire.encode(wire.Cmd.HEARTBEAT, {
                        "rid": m.header["rid"], "status": "ok", "routes": [["w", worker_ep, socket.gethostname()]]})])

    def answer_and_leave():
        ident, *frames = worker.recv_multipart()
        worker.send_multipart([ident, *wire.encode_error(wire.decode(frames).header["rid"], wire.STATUS_FINAL,
                                                          "the worker's answer")])
        time.sleep(0.05)
        worker.close(linger=1000)

    threads = [threading.Thread(target=serve_table, daemon=True), threading.Thread(target=answer_and_leave,
                                                                                   daemon=True)]
    for t in threads:
        t.start()
    c = Client(broker_ep, context=ctx, timeout=2.0, retries=0, lanes=False)    # a bare socket takes no lane
    try:
        c._ask_routes()
        wait_until(lambda: _connected(c._routes, "w"), 5, "the route never connected")
        build = lambda rid, cid: wire.encode(wire.Cmd.REQUEST, {"rid": rid, "cid": cid})      # noqa: E731
        # The call is busy (as predict is, tokenizing after the send) while the answer comes and the worker leaves.
        msg, attempts = c.call(wire.Cmd.REQUEST, build, on_sent=lambda: time.sleep(0.3), direct=True)
        assert msg.header["error"]["message"] == "the worker's answer" and attempts == 1
        assert c._routes.sent == 1
    finally:
        stop.set()
        c.close()
        for t in threads:
            t.join(5)
        broker.close(0)
        ctx.destroy(0)


def _echo(sock, stop, routes=None):
    """A bare ROUTER answering every request at once (and, as a broker, the table question): the client's own
    speed is what is measured."""
    while not stop.is_set():
        if sock.poll(20):
            ident, *frames = sock.recv_multipart()
            m = wire.decode(frames)
            if m.cmd == wire.Cmd.HEARTBEAT:
                sock.send_multipart([ident, *wire.encode(wire.Cmd.HEARTBEAT, {"rid": m.header["rid"], "status": "ok",
                                                                              "routes": routes})])
            else:
                sock.send_multipart([ident, *wire.encode_error(m.header["rid"], wire.STATUS_FINAL, "echo")])


def test_an_asyncio_client_keeps_going_direct_under_load():
    """Many concurrent calls over one AsyncClient(direct=True) to an instant worker: every attempt but the first
    few goes direct and is answered there. Sent through the socket's plain view, a reply could wait for the next
    event on its descriptor (ZeroMQ's edge-triggered readiness), its attempt time out, the worker be blamed and the
    traffic move to the broker: 197 of ~13,000 calls went direct that way."""
    import asyncio
    import socket
    import threading

    from laya_pool.client.pool_async import AsyncClient

    ctx = zmq.Context()
    broker, broker_ep = _worker_socket(ctx)
    worker, worker_ep = _worker_socket(ctx)
    stop = threading.Event()
    threads = [threading.Thread(target=_echo, args=(worker, stop), daemon=True),
               threading.Thread(target=_echo, args=(broker, stop, [["w", worker_ep, socket.gethostname()]]),
                                daemon=True)]
    for t in threads:
        t.start()

    async def go():
        c = AsyncClient(broker_ep, direct=True, timeout=5.0, retries=3)
        build = lambda rid, cid: wire.encode(wire.Cmd.REQUEST, {"rid": rid, "cid": cid})      # noqa: E731
        await c.call(wire.Cmd.REQUEST, build, direct=True)
        await asyncio.sleep(0.2)                  # its connection made
        calls = 0

        async def loop():
            nonlocal calls
            for _ in range(150):
                msg, attempts = await c.call(wire.Cmd.REQUEST, build, direct=True)
                assert msg.header["error"]["message"] == "echo"
                calls += 1
        await asyncio.gather(*(loop() for _ in range(16)))
        sent, dropped = c._routes.sent, c._routes.dropped
        c.close()
        return calls, sent, dropped

    try:
        calls, sent, dropped = asyncio.run(go())
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        broker.close(0)
        worker.close(0)
        ctx.destroy(0)
    assert calls == 2400 and sent >= 0.95 * calls and dropped == 0, (calls, sent, dropped)
