"""client/direct.py: the choice of worker, the broker's table, and the direct sockets' life (real ZeroMQ sockets;
the pool-level behaviour, kill -9 included, is in tests/test_pool.py)."""
from __future__ import annotations

import zmq
from conftest import wait_until
from laya_pool.client.direct import Route, Routes, pick, usable
from laya_pool.protocol import wire


def _route(worker: str, outstanding: int, up: bool = True) -> Route:
    return Route(worker, f"tcp://127.0.0.1:{1000 + int(worker)}", outstanding=set(range(outstanding)), up=up)


def test_pick_takes_the_least_outstanding_usable_route_and_turns_on_ties():
    rs = [_route("0", 2), _route("1", 1), _route("2", 1), _route("3", 0, up=False)]
    assert pick(rs, 0).worker == "1"
    assert pick(rs, 2).worker == "2"            # a tie goes to the first from the turn on
    assert pick([_route("0", 0, up=False)], 0) is None
    assert pick([], 0) is None


def test_the_table_keeps_only_loopback_routes_on_this_host():
    table = [["0", "tcp://127.0.0.1:5000", "here"], ["1", "tcp://10.0.0.7:5000", "here"],
             ["2", "tcp://127.0.0.1:5001", "elsewhere"], ["3", "ipc:///tmp/w3", "here"], ["4", 5, "here"], "junk"]
    assert usable(table, "here") == {"0": "tcp://127.0.0.1:5000", "3": "ipc:///tmp/w3"}
    assert usable(None, "here") == {} and usable({"0": "x"}, "here") == {}


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
        # Sent only once the connection is made (ZMQ_IMMEDIATE): before, the attempt would go to the broker.
        wait_until(lambda: routes.send(7, frames), 5, "the route never took a request")
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
        wait_until(lambda: routes.send(1, frames), 5, "the route never took a request")
        routes.answered(1, wire.STATUS_OK)
        assert routes.routes["w"].up and not routes.routes["w"].outstanding
        assert routes.send(2, frames)
        routes.answered(2, wire.STATUS_RETRYABLE, "stopping")
        assert routes.routes["w"].up is False and routes.send(3, frames) is False
        routes.asked([["w", endpoint, "here"]], now=1.0)    # listed as ready again (a restarted drain)
        assert routes.routes["w"].up
    finally:
        routes.close()
        ctx.destroy(0)
