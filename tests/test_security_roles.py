"""Who may do what: a tcp worker endpoint needs keys (loopback included); without the worker key a process can
neither register nor take over a worker id; under CURVE only the operator key drains; refused handshakes log."""
from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from conftest import SUBPROCESS_ENV, free_port, wait_until

from laya_pool.broker.security import generate
from laya_pool.client.errors import PoolUnavailable, RequestFailed
from laya_pool.client.pool import Client
from laya_pool.client.pool_async import AsyncClient
from laya_pool.protocol import wire
from laya_pool.protocol.contract import Reason

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)



def _ready(wid: str, pid: int) -> list:
    return wire.encode(wire.Cmd.READY, {"id": wid, "device": "cpu", "fingerprint": "f" * 64, "pid": pid,
                                        "credit": 1, "capacity": {"max_tokens": 64, "max_rows": 1,
                                                                  "max_markers": 4}})


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "laya_pool", *args], env=SUBPROCESS_ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_a_tcp_worker_endpoint_needs_keys_even_on_loopback(tmp_path, tiny_ckpt):
    be = f"tcp://127.0.0.1:{free_port()}"
    r = _cli("broker", "--frontend", f"ipc://{tmp_path}/fe", "--backend", be)
    assert r.returncode == 2 and "without CURVE keys" in r.stderr and "--insecure-backend" in r.stderr, r.stderr
    r = _cli("up", "--model", str(tiny_ckpt), "--frontend", f"ipc://{tmp_path}/fe2", "--backend", be)
    assert r.returncode == 2 and "--insecure-backend" in r.stderr, r.stderr
    # Asked for explicitly, it runs, and says so in the log.
    log = tmp_path / "broker.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", f"ipc://{tmp_path}/fe3",
                              "--backend", be, "--insecure-backend"], env=SUBPROCESS_ENV, cwd=ROOT, stdout=out,
                             stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "--insecure-backend: " in log.read_text(), 30, lambda: log.read_text())
    finally:
        p.terminate()
        p.wait(20)


def test_without_the_worker_key_no_registration_or_takeover_and_only_the_operator_key_drains(tmp_path):
    keys = tmp_path / "keys"
    generate(keys)
    fe, be = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path / "broker.log"
    with open(log, "w") as out:
        broker = subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend", be,
                                   "--keys", str(keys), "--heartbeat-ms", "300", "--liveness", "100"],
                                  env=SUBPROCESS_ENV, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    ctx = zmq.Context()
    socks = []

    def dealer(role: str | None, wid: str) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, wid.encode())
        s.setsockopt(zmq.LINGER, 0)
        if role:
            wire.configure_curve_client(s, keys, role=role)
        s.connect(be)
        socks.append(s)
        return s

    try:
        honest = dealer("worker", "w")
        with Client(fe, keys=str(keys), timeout=30.0, connect_timeout=30.0) as c:   # waits for the broker to bind
            def registered():
                rows = {w["id"]: w for w in c.status()["workers"]}
                if "w" not in rows:
                    honest.send_multipart(_ready("w", 1))
                return rows.get("w")
            assert wait_until(registered, 30, "the worker key must be admitted", interval=0.3)["pid"] == 1
            # The same id, from a client key and from a peer with no key at all: both knock for a while.
            intruders = [dealer("client", "w"), dealer(None, "w"), dealer("client", "x")]
            for _ in range(10):
                for s in intruders:
                    with contextlib.suppress(zmq.Again):       # refused peers never get a pipe: it fills
                        s.send_multipart(_ready("w" if s is not intruders[2] else "x", 666), zmq.NOBLOCK)
                time.sleep(0.1)
            rows = {w["id"]: w for w in c.status()["workers"]}
            assert set(rows) == {"w"} and rows["w"]["pid"] == 1 and rows["w"]["registrations"] == 1, rows
            # A client key reaches the frontend but is not the operator's.
            with pytest.raises(RequestFailed) as e:
                c.drain("w")
            assert e.value.reason == Reason.NOT_ALLOWED and "operator key" in str(e.value)
        with Client(fe, keys=str(keys), key_role="operator", timeout=2.0, retries=0) as op:
            assert op.drain("w")["state"] == "draining"
        # A client without keys is told what to fix, not "no reply" or "the send queue is full".
        with Client(fe, timeout=1.0, retries=1) as plain, pytest.raises(PoolUnavailable) as e:
            plain.status()
        assert "expects CURVE keys" in str(e.value) and "keys=DIR" in str(e.value), str(e.value)
        def knock_and_look(side: str) -> bool:
            # Which end of a refused handshake notices the mismatch first is a race (the broker may see only the
            # client breaking off, and a refused client does not reconnect): keyless peers keep knocking, as the
            # intruders do on the backend.
            socks.append(ctx.socket(zmq.DEALER))
            socks[-1].setsockopt(zmq.LINGER, 0)
            socks[-1].connect(be if side == "backend" else fe)    # knock on the side whose line is awaited
            return f"{side} socket: refused a connection: the peer speaks another security" in log.read_text()
        for side in ("backend", "frontend"):
            wait_until(lambda side=side: knock_and_look(side), 10,
                       lambda: "a refused handshake must be logged:\n" + log.read_text(), interval=0.2)
        assert log.read_text().count("frontend socket: refused a connection: the peer speaks") == 1, "rate-limited"

        async def plain_async() -> None:
            async with AsyncClient(fe, timeout=1.0, retries=1) as a:
                await a.status()
        with pytest.raises(PoolUnavailable) as e:        # the asyncio client says the same
            asyncio.run(plain_async())
        assert "expects CURVE keys" in str(e.value) and "keys=DIR" in str(e.value), str(e.value)
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        broker.terminate()
        broker.wait(20)


def test_connection_watch_rules():
    from laya_pool.client.watch import ConnectionWatch
    w = ConnectionWatch()
    assert not w.feed(zmq.EVENT_HANDSHAKE_SUCCEEDED), "the first connection is not a reconnection"
    assert not w.feed(zmq.EVENT_DISCONNECTED)
    assert not w.feed(zmq.EVENT_DISCONNECTED), "retries while the broker is down"
    assert w.feed(zmq.EVENT_HANDSHAKE_SUCCEEDED), "back after a drop: re-send"
    assert not w.feed(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL) and "CURVE" in w.trouble
    assert not w.feed(zmq.EVENT_HANDSHAKE_SUCCEEDED) and w.trouble is None
