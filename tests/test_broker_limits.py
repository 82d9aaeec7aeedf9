"""The broker's memory is bounded in bytes, not only in counts, and deduplication needs a client id."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import zmq
from conftest import SUBPROCESS_ENV, wait_until

from laya_pool.client.pool import Client
from laya_pool.protocol import wire

ROOT = Path(__file__).resolve().parents[1]
ENV = SUBPROCESS_ENV


def _request(rid: int, n_tokens: int, cid: str | None) -> list:
    ids = np.full(n_tokens, 7, np.int32)
    arrays = dict(zip(wire.REQUEST_ARRAYS, [ids, np.array([n_tokens], np.int32), np.zeros(1, np.int32),
                                            np.ones(1, np.int32), np.zeros(1, np.int32)]))
    return wire.encode_request(rid, arrays, cid=cid)


def test_queue_bytes_are_bounded_and_cid_is_required(tmp_path):
    fe, be = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be"
    broker = subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend", be,
                               "--queue-max-bytes", "6000", "--queue-timeout", "30"], env=ENV, cwd=ROOT)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fe)
    try:
        with Client(fe, timeout=30.0, connect_timeout=30.0) as c:   # waits for the broker to bind
            c.status()                                  # the broker is up
        replies = {}

        def recv(rid):
            def arrived():
                if sock.poll(100):
                    rep = wire.parse_reply(wire.decode(sock.recv_multipart()))
                    replies[rep.rid] = rep
                return replies.get(rid)
            return wait_until(arrived, 10, f"no reply to {rid}", interval=0)

        # No worker is up, so accepted requests wait in the queue: the first (4 KB) fits, the second does not.
        sock.send_multipart(_request(1, 1000, "c1"))
        sock.send_multipart(_request(2, 1000, "c1"))
        busy = recv(2)
        assert busy.status == wire.STATUS_RETRYABLE and (busy.error or {}).get("reason") == "busy"
        assert "B queued" in busy.message
        sock.send_multipart(_request(3, 10, None))
        refused = recv(3)
        assert refused.status == wire.STATUS_FINAL and (refused.error or {}).get("field") == "cid"
        assert 1 not in replies, "the queued request must still be waiting, not answered"
        with Client(fe, timeout=2.0, retries=1) as c:
            st = c.status()
        assert st["broker"]["queue"] == 1 and 4000 <= st["broker"]["queue_bytes"] <= 6000
    finally:
        sock.close(0)
        ctx.term()
        broker.terminate()
        broker.wait(20)
