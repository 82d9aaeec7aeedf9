"""CURVE roles: a client's key reaches the frontend only; registering a worker needs the worker key."""
import contextlib
import subprocess
import sys
from pathlib import Path

import zmq
from conftest import SUBPROCESS_ENV, free_port, wait_until

from laya_pool.broker.security import generate
from laya_pool.client.pool import Client
from laya_pool.protocol import wire

ROOT = Path(__file__).resolve().parents[1]
ENV = SUBPROCESS_ENV



def _ready_frames(wid: str) -> list:
    return wire.encode(wire.Cmd.READY, {"id": wid, "device": "cpu", "fingerprint": "f" * 64, "pid": 1,
                                        "credit": 1, "capacity": {"max_tokens": 64, "max_rows": 1,
                                                                  "max_markers": 4}})


def test_client_key_cannot_register_a_worker(tmp_path):
    keys = tmp_path / "keys"
    generate(keys)
    assert (keys / "authorized-workers" / "worker.key").is_file() and (keys / "worker.key_secret").is_file()
    fe, be = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend", be,
                               "--keys", str(keys), "--heartbeat-ms", "300"], env=ENV, cwd=ROOT)
    ctx = zmq.Context()
    try:
        socks = {}
        for role, wid in (("client", "intruder"), ("worker", "honest")):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, wid.encode())
            s.setsockopt(zmq.LINGER, 0)
            wire.configure_curve_client(s, keys, role=role)
            s.connect(be)
            socks[wid] = s
        with Client(fe, keys=str(keys), timeout=30.0, connect_timeout=30.0) as c:   # waits for the broker to bind
            def admitted():
                # Both knock (again) until the worker key is in; the client key knocked just as often.
                ids = {w["id"] for w in c.status()["workers"]}
                if "honest" not in ids:
                    for wid, s in socks.items():
                        # Never block: a socket whose handshake was refused has no pipe left to queue on.
                        with contextlib.suppress(zmq.Again):
                            s.send_multipart(_ready_frames(wid), flags=zmq.NOBLOCK)
                return ids if "honest" in ids else None
            ids = wait_until(admitted, 30, "the worker key must be admitted on the backend", interval=0.3)
            assert "intruder" not in ids, "a client key must not register a worker"
    finally:
        for s in socks.values():
            s.close(0)
        ctx.term()
        broker.terminate()
        broker.wait(20)
