"""Who may register as a worker without CURVE keys (issue #54), with real brokers, workers and sockets.

The threat model's one rule for processes of the pool's user: trusted as far as they read the run directory. A
process that does not read it (a client library, another pool's worker, a tool pointed at the wrong endpoint) cannot
register on the default ipc backend: the broker wants READY's `proof`, made from the worker secret in that directory.
One that reads it can, like the pool's own workers; but no registration, proved or not, takes a live worker's id.
`--insecure-backend` takes workers without proof, still never on a live worker's id. The operator secret is found
whichever spelling of the frontend's loopback host a command is given.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import pytest
import zmq
from conftest import ROOT, SUBPROCESS_ENV, free_port, make_rows, wait_until

from laya_pool.broker import operator
from laya_pool.client.local import local_pool
from laya_pool.client.pool import Client
from laya_pool.protocol import credentials, wire
from laya_pool.protocol.wire import Cmd

pytestmark = pytest.mark.timeout(120)
OTHER_FP = "e" * 64


def _ready(wid: str, pid: int, proof: str | None = None, fp: str = OTHER_FP) -> list:
    h = {"id": wid, "device": "cpu", "fingerprint": fp, "pid": pid, "credit": 1,
         "capacity": {"max_tokens": 64, "max_rows": 1, "max_markers": 4}}
    return wire.encode(Cmd.READY, {**h, **({"proof": proof} if proof else {})})


class Peers:
    """Raw DEALERs on a backend, closed at the end; `knock` sends READY until the broker answers DISCONNECT."""

    def __init__(self, backend: str):
        self.backend, self.ctx, self.socks = backend, zmq.Context(), []

    def dealer(self, identity: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, identity.encode())
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.backend)
        self.socks.append(s)
        return s

    def knock(self, s: zmq.Socket, frames: list, seconds: float = 3.0) -> list[str]:
        """READY every 0.3 s for `seconds`: the DISCONNECT reasons and the commands the broker sent back."""
        got, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            with contextlib.suppress(zmq.Again):
                s.send_multipart(frames, zmq.NOBLOCK)
            while time.monotonic() < end and s.poll(300):     # (a registered one is sent heartbeats: no end)
                msg = wire.decode(s.recv_multipart())
                got.append(msg.header.get("reason", "") if msg.cmd == Cmd.DISCONNECT else msg.cmd.name)
        return got

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.ctx.term()


def test_a_same_user_process_registers_only_with_the_pools_secret_and_never_on_a_live_id(tiny_ckpt):
    with local_pool(tiny_ckpt, "cpu", heartbeat_ms=250, liveness=4, extra_args=["--threads", "1"]) as pool, \
            Client(pool.endpoint, timeout=10.0) as c:
        backend = pool.endpoint.rsplit("/", 1)[0] + "/backend"
        rows = make_rows(4, n=2)
        want = c.forward(rows).flat
        w0 = {w["id"]: w for w in c.status()["workers"]}["0"]
        peers = Peers(backend)
        try:
            # Without the secret: a new id, the live worker's id (as its own old-style identity), a forged suffix.
            for identity, wid in (("intruder", "intruder"), ("0", "0"), ("0@0123abcd", "0")):
                got = peers.knock(peers.dealer(identity), _ready(wid, 666, fp=w0["fingerprint"]))
                assert got and all(r.startswith("registration refused: this pool takes only the workers it "
                                                "started") for r in got), (identity, got)
            # With it (read from the run directory, as the pool's own workers do): a live worker's id stays its own.
            token = credentials.read(credentials.WORKER, backend)
            assert token is not None
            taker = peers.dealer("0@89abcdef")
            got = peers.knock(taker, _ready("0", 667, credentials.proof(token, b"0@89abcdef"), w0["fingerprint"]))
            assert got and all("is held by a live worker" in r for r in got), got
            # ... and a new id is taken (another model: it is never sent the pool's requests).
            trusted = peers.dealer("reader@01234567")
            assert "HEARTBEAT" in peers.knock(trusted, _ready("reader", 668, credentials.proof(
                token, b"reader@01234567")), seconds=1.0)
            for _ in range(5):
                assert (c.forward(rows).flat == want).all()
            table = {w["id"]: w for w in c.status()["workers"]}
        finally:
            peers.close()
        assert set(table) == {"0", "reader"}, table
        assert table["reader"]["completed"] == 0 and table["reader"]["state"] in ("mismatch", "dead"), table["reader"]
        assert (table["0"]["pid"], table["0"]["registrations"]) == (w0["pid"], w0["registrations"])
        log = pool.log()
        for line in ("refused a READY for worker intruder", "refused a READY for worker 0 (pid 667)"):
            assert line in log, log[-3000:]
        assert log.count("refused a READY for worker") <= 4, "one line per kind every 10 s"


def _bare_broker(tmp_path, *flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str, str, object]:
    fe, be = f"tcp://127.0.0.1:{free_port()}", f"ipc://{tmp_path}/be"
    log = tmp_path / "broker.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend", be,
                              "--heartbeat-ms", "250", "--liveness", "40", *flags], env=env or SUBPROCESS_ENV,
                             cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    return p, fe, be, log


def test_insecure_backend_admits_unknown_workers_but_never_over_a_live_one(tmp_path):
    broker, fe, be, log = _bare_broker(tmp_path, "--insecure-backend")
    peers = Peers(be)
    try:
        with Client(fe, timeout=30.0, connect_timeout=30.0) as c:
            first = peers.dealer("w1")
            wait_until(lambda: peers.knock(first, _ready("w1", 1), 0.5) and
                       {w["id"]: w["pid"] for w in c.status()["workers"]}.get("w1") == 1, 30, "w1 not admitted")
            before = {w["id"]: w for w in c.status()["workers"]}["w1"]["registrations"]
            # The same identity (ZeroMQ no longer hands a live route over) and another one: w1 stays w1.
            same = peers.dealer("w1")
            for _ in range(5):
                with contextlib.suppress(zmq.Again):
                    same.send_multipart(_ready("w1", 2), zmq.NOBLOCK)
                time.sleep(0.1)
            other = peers.dealer("w1@fedcba98")
            got = peers.knock(other, _ready("w1", 3), 1.5)
            assert got and all("is held by a live worker (pid 1)" in r for r in got), got
            w1 = {w["id"]: w for w in c.status()["workers"]}["w1"]
            assert (w1["pid"], w1["registrations"]) == (1, before), w1
            # Once the first process is gone (its socket closed), its successor is taken at once.
            first.close(0)
            wait_until(lambda: peers.knock(other, _ready("w1", 3), 0.5) and
                       {w["id"]: w["pid"] for w in c.status()["workers"]}.get("w1") == 3, 10,
                       "the successor of a dead worker must be admitted")
        assert "refused a READY for worker w1 (pid 3): worker id 'w1' is held by a live worker" in log.read_text()
    finally:
        peers.close()
        broker.terminate()
        broker.wait(20)


def test_the_operator_secret_is_found_whatever_the_hosts_spelling(tmp_path):
    port = free_port()
    same = {operator.secret_path(f"tcp://{h}:{port}") for h in ("127.0.0.1", "localhost", "[::1]", "127.0.0.2", "*")}
    assert len(same) == 1 and operator.secret_path(f"tcp://127.0.0.1:{port + 1}") not in same
    assert operator.secret_path("tcp://10.0.0.5:5555") != operator.secret_path("tcp://127.0.0.1:5555")
    broker, fe, be, log = _bare_broker(tmp_path, "--insecure-backend")
    port = fe.rsplit(":", 1)[1]
    peers = Peers(be)
    try:
        with Client(fe, timeout=30.0, connect_timeout=30.0) as c:
            w = peers.dealer("w7")
            wait_until(lambda: peers.knock(w, _ready("w7", 7), 0.5) and
                       any(x["id"] == "w7" for x in c.status()["workers"]), 30, "w7 not admitted")
        assert operator.read_secret(f"tcp://[::1]:{port}") == operator.read_secret(fe) is not None
        # The operator's command, given the frontend as localhost (the broker bound 127.0.0.1), drains.
        r = subprocess.run([sys.executable, "-m", "laya_pool", "drain", "w7", "--frontend", f"tcp://localhost:{port}"],
                           env=SUBPROCESS_ENV, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "draining" in r.stdout, (r.returncode, r.stdout, r.stderr)
    finally:
        peers.close()
        broker.terminate()
        broker.wait(20)


def test_workers_of_another_run_directory_register_with_the_brokers_worker_secret_file(tiny_ckpt, tmp_path,
                                                                                        monkeypatch):
    """`laya-pool workers` joining a broker without keys on this host, under another run directory (another
    LAYA_POOL_RUNTIME_DIR, as a unit or a container of its own has): without the broker's worker secret its worker is
    refused and says where it looked; handed the broker's file (--worker-secret-file), its worker registers."""
    run_broker, run_workers = tmp_path / "run-broker", tmp_path / "run-workers"
    broker, fe, be, log = _bare_broker(tmp_path, env=dict(SUBPROCESS_ENV, LAYA_POOL_RUNTIME_DIR=str(run_broker)))
    monkeypatch.setenv("LAYA_POOL_RUNTIME_DIR", str(run_broker))
    secret = credentials.secret_path(credentials.WORKER, be)
    env = dict(SUBPROCESS_ENV, LAYA_POOL_RUNTIME_DIR=str(run_workers))
    hosts: list[subprocess.Popen] = []

    def workers(name: str, *flags: str) -> tuple[subprocess.Popen, object]:
        out = tmp_path / f"{name}.log"
        with open(out, "w") as f:
            hosts.append(subprocess.Popen([sys.executable, "-m", "laya_pool", "workers", "--broker", be, "--model",
                                           str(tiny_ckpt), "--name", name, "--heartbeat-ms", "250", "--liveness", "40",
                                           "--threads", "1", *flags], env=env, cwd=ROOT, stdout=f,
                                          stderr=subprocess.STDOUT))
        return hosts[-1], out
    try:
        wait_until(secret.exists, 30, lambda: f"the broker wrote no worker secret:\n{log.read_text()[-2000:]}")
        assert f"worker secret in {secret}" in log.read_text()      # where an operator finds the file to hand over
        _, lost_log = workers("lost")
        _, found_log = workers("found", "--worker-secret-file", str(secret))
        with Client(fe, timeout=30.0, connect_timeout=30.0) as c:
            wait_until(lambda: {w["id"]: w["state"] for w in c.status()["workers"]}.get("found-0") == "ready", 90,
                       lambda: f"the worker with the secret file did not register:\n{found_log.read_text()[-2000:]}")
            wait_until(lambda: "registration refused" in lost_log.read_text(), 60,
                       lambda: f"the worker without the secret was not refused:\n{lost_log.read_text()[-2000:]}")
            assert "lost-0" not in {w["id"] for w in c.status()["workers"]}
        said = next(ln for ln in lost_log.read_text().splitlines() if "registration refused" in ln)
        assert "this pool takes only the workers it started" in said and str(run_workers) in said, said
        assert "none there" in said, said
        assert "refused a READY for worker lost-0" in log.read_text()
    finally:
        for p in (*hosts, broker):
            p.terminate()
        for p in (*hosts, broker):
            p.wait(30)
