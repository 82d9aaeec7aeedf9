"""Clients straight to the workers in a pool with CURVE keys (docs/architecture.md, "The data path", item 1): each
worker's direct socket is a CURVE server with the worker's key pair, admitting the keys the broker's frontend admits;
the broker's table carries that key, so a client with the pool's keys authenticates the worker, from any host."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq
from conftest import SUBPROCESS_ENV, free_port, make_rows, reference_logits, wait_until

from laya_pool.broker.supervisor import SupervisorConfig, _direct_beyond_loopback
from laya_pool.client.local import local_pool
from laya_pool.client.pool import Client
from laya_pool.client.pool_async import AsyncClient
from laya_pool.protocol import wire


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    out = tmp_path_factory.mktemp("curve") / "keys"
    r = subprocess.run([sys.executable, "-m", "laya_pool", "keys", "--out", str(out)], env=SUBPROCESS_ENV,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def curve_pool(tiny_ckpt, keys, tmp_path_factory):
    """One CPU worker with keys taking requests on its data thread and its direct socket (lanes off: the socket's
    authentication is what is tested), a tcp frontend on loopback; the direct socket on every address (announced by
    this host's name, which a client on another host could reach)."""
    log = tmp_path_factory.mktemp("curve-pool") / "pool.log"
    env = {"LAYA_DATA_REQUESTS": "on", "LAYA_DIRECT": "on", "LAYA_LANES": "off", "LAYA_WORKER_POLL_US": "200000",
           "LAYA_DIRECT_ENDPOINT": "tcp://0.0.0.0:*"}
    with local_pool(tiny_ckpt, "cpu", frontend=f"tcp://127.0.0.1:{free_port()}", keys=str(keys), log=log, env=env,
                    startup_timeout=180) as pool:
        yield pool
    text = log.read_text()
    assert pool.process.returncode == 0 and "Traceback" not in text, text[-3000:]


def _table(c: Client) -> list:
    msg, _ = c.call(wire.Cmd.HEARTBEAT, lambda rid, cid: wire.encode(wire.Cmd.HEARTBEAT, {"rid": rid, "routes": True}),
                    10.0, 0)
    return msg.header["routes"]


def _taken_directly(pool) -> int:
    return sum(w.get("stats", {}).get("direct", 0) for w in pool.status()["workers"])


@pytest.mark.parametrize("host", [None, "another-host"])
def test_a_client_with_keys_sends_to_the_worker_itself_and_gets_the_same_answers(curve_pool, tiny_runtime, host):
    """From this host and as a client on another host would (the table's host is not its own: what makes the route
    usable is the worker's key, and no lane is asked for)."""
    rows = make_rows(21)
    want = reference_logits(tiny_runtime, rows)
    with curve_pool.client(timeout=30) as c:
        if host is not None:
            c._routes.host = host
        table = _table(c)
        assert len(table) == 1 and wire.is_curve_key(table[0][3]), table
        assert table[0][1].startswith(f"tcp://{socket.gethostname()}:"), table     # the wildcard bind, by name
        before = _taken_directly(curve_pool)
        c.forward(rows)                                   # the table comes with the first call
        wait_until(lambda: c.ping() is not None and all(r.connected for r in c._routes.routes.values())
                   and len(c._routes.routes) == 1, 30, "the route never connected")
        route = next(iter(c._routes.routes.values()))
        assert route.key == table[0][3] and route.local is (host is None)
        if host is not None:
            assert route.lane is None and not route.lane_refused       # a lane only for a worker on this host
        sent = c._routes.sent
        for _ in range(8):
            np.testing.assert_allclose(c.forward(rows).flat, want, rtol=1e-5, atol=1e-5)
        assert c._routes.sent - sent == 8
    wait_until(lambda: _taken_directly(curve_pool) - before >= 8, 30, "the worker never counted them")


def _stranger(ctx: zmq.Context, endpoint: str, server_key: str | None, keypair: tuple[bytes, bytes] | None):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        s.curve_publickey, s.curve_secretkey = keypair
        s.curve_serverkey = server_key.encode()
    mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    s.connect(endpoint)
    return s, mon


def test_the_direct_socket_refuses_keys_it_does_not_admit_and_keeps_serving(curve_pool, tiny_runtime, keys):
    """Key pairs the pool does not admit (a stranger's; the workers' own, which only the backend admits) are refused
    by the worker's ZAP handler, a peer without CURVE by the handshake; an admitted client goes on being served
    directly."""
    from zmq.utils.monitor import recv_monitor_message

    rows = make_rows(22)
    with curve_pool.client(timeout=30) as c:
        _, endpoint, _, key = _table(c)[0]
    ctx = zmq.Context()
    try:
        workers = zmq.auth.load_certificate(str(keys / "worker.key_secret"))
        refused = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        for server_key, keypair, want in ((key, zmq.curve_keypair(), (zmq.EVENT_HANDSHAKE_FAILED_AUTH,)),
                                          (key, workers, (zmq.EVENT_HANDSHAKE_FAILED_AUTH,)),
                                          (None, None, refused)):
            s, mon = _stranger(ctx, endpoint, server_key, keypair)
            events = []
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                if mon.poll(100):
                    events.append(recv_monitor_message(mon)["event"])
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events, events
            assert set(want) & set(events), events     # refused by the worker, not an endpoint that is not there
            s.close(0)
            mon.close(0)
    finally:
        ctx.destroy(0)
    want = reference_logits(tiny_runtime, rows)
    with curve_pool.client(timeout=30) as c:
        before = c._routes.sent if c._routes else 0
        for _ in range(3):
            np.testing.assert_allclose(c.forward(rows).flat, want, rtol=1e-5, atol=1e-5)
        assert c._routes.sent - before >= 2        # the first may go to the broker while the route connects


def test_a_pool_beyond_loopback_puts_the_direct_sockets_where_its_frontend_is():
    cfg = SupervisorConfig(model="m", devices=["cuda:0"], frontend="tcp://10.0.0.5:5555", keys="/k")
    assert _direct_beyond_loopback(cfg, {})
    assert not _direct_beyond_loopback(cfg, {"LAYA_DIRECT_ENDPOINT": "tcp://10.0.0.6:*"})   # the operator's choice
    cfg.worker_args = ["--direct-endpoint", "tcp://10.0.0.6:*"]
    assert not _direct_beyond_loopback(cfg, {})
    for frontend, k in (("tcp://127.0.0.1:5555", "/k"), ("ipc:///tmp/fe", "/k"), ("tcp://10.0.0.5:5555", None)):
        assert not _direct_beyond_loopback(SupervisorConfig(model="m", devices=["cpu"], frontend=frontend, keys=k), {})
    assert _direct_beyond_loopback(SupervisorConfig(model="m", devices=["cpu"], frontend="tcp://*:5555", keys="/k"), {})


def test_an_asyncio_client_with_keys_goes_to_the_worker_itself(curve_pool, tiny_runtime):
    rows = make_rows(23)
    want = reference_logits(tiny_runtime, rows)

    async def main() -> int:
        async with AsyncClient(curve_pool.endpoint, timeout=30, keys=str(curve_pool.keys)) as c:
            c._routes.host = "another-host"
            await c.forward(rows)
            for _ in range(300):
                if c._routes.routes and all(r.connected for r in c._routes.routes.values()):
                    break
                await c.ping()
                await asyncio.sleep(0.05)
            sent = c._routes.sent
            got = await asyncio.gather(*(c.forward(rows) for _ in range(6)))
            for g in got:
                np.testing.assert_allclose(g.flat, want, rtol=1e-5, atol=1e-5)
            return c._routes.sent - sent
    assert asyncio.run(main()) == 6


def _handshakes(ctx: zmq.Context, endpoint: str, keys, seconds: float) -> bool:
    """Whether an admitted client's handshake with the worker key's server at `endpoint` succeeds within `seconds`."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.curve_publickey, s.curve_secretkey = zmq.auth.load_certificate(str(keys / "client.key_secret"))
    s.curve_serverkey = zmq.auth.load_certificate(str(keys / "worker.key"))[0]
    mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    s.connect(endpoint)
    try:
        return bool(mon.poll(int(seconds * 1000)))
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the planted break
def test_a_dead_zap_handler_refuses_everyone_and_stops_without_hanging(keys):
    """A direct socket whose ZAP handler died admits nobody, not everybody (ZAP_ENFORCE_DOMAIN), and stopping the
    handler then returns (pyzmq's own stop would wait forever on the dead thread), so the context can end."""
    async def broken(*_a, **_k):
        raise RuntimeError("planted: the handler breaks")

    ctx = zmq.Context()
    auth = wire.start_authenticator(ctx, {"clients": keys / "authorized"})
    server = ctx.socket(zmq.ROUTER)
    wire.configure_curve_server(server, keys, "worker", "clients")
    server.bind("tcp://127.0.0.1:*")
    endpoint = server.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        assert _handshakes(ctx, endpoint, keys, 5)               # alive: an admitted key gets in
        auth.thread.authenticator.handle_zap_message = broken
        assert not _handshakes(ctx, endpoint, keys, 1)           # the request that kills it
        wait_until(lambda: not auth.is_alive(), 10, "the handler never died")
        assert not _handshakes(ctx, endpoint, keys, 1.5)         # dead: nobody answers for the pool, nobody gets in
        done = threading.Event()
        threading.Thread(target=lambda: (wire.stop_authenticator(auth), done.set()), daemon=True).start()
        assert done.wait(5), "stopping a dead handler hung"
        assert not _handshakes(ctx, endpoint, keys, 1.5)         # no handler at all: still nobody
    finally:
        server.close(0)
    ender = threading.Thread(target=ctx.term, daemon=True)
    ender.start()
    ender.join(5)
    assert not ender.is_alive(), "the context could not end"


def test_a_direct_socket_that_cannot_bind_says_why_and_leaves_no_handler(keys):
    """An address this host does not have: the bind's own error, and the ZAP handler it started is stopped (its
    thread would keep the context from ending)."""
    from laya_pool.worker.inbox import SocketInbox
    ctx = zmq.Context()
    with pytest.raises(zmq.ZMQError):
        SocketInbox(ctx, "tcp://127.0.0.1:1", "w1", keys=str(keys), max_message_bytes=1 << 20,
                    direct="tcp://192.0.2.1:*")
    ender = threading.Thread(target=lambda: ctx.destroy(0), daemon=True)
    ender.start()
    ender.join(5)
    assert not ender.is_alive(), "the context could not end"
