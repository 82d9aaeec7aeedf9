"""A peer that never reads its replies cannot grow the broker without bound, and other clients do not notice.

The attack from issue #14: 8,000 describe requests (each answered with the ~58 KB model card) from a socket
that never reads. Before: the broker grew from 40 to 483 MiB. Now each client's queue is capped
(`--client-hwm`, 1000 replies) and the card is one shared buffer (sent zero-copy), so the broker grows by a
few MiB at most; the bound tested is 64 MiB.
"""
from __future__ import annotations

import time

import psutil
import pytest
import zmq
from conftest import make_rows, wait_until

from laya_pool.client.local import local_pool
from laya_pool.client.pool import Client
from laya_pool.protocol import wire

pytestmark = pytest.mark.timeout(180)
N_UNREAD = 8000
GROWTH_LIMIT = 64 << 20


def test_a_peer_that_never_reads_keeps_the_broker_bounded(tiny_ckpt):
    with local_pool(tiny_ckpt, "cpu", heartbeat_ms=250, liveness=4, extra_args=["--threads", "1"]) as pool, \
            Client(pool.endpoint, timeout=10.0) as good:
        card = good.describe()                       # the broker holds the card from now on
        assert len(wire.pack(card)) > 40_000, "the test needs a card of tens of KB"
        st = good.status()
        broker = psutil.Process(st["broker"]["pid"])
        seen = st["broker"]["counters"].get("frontend_messages", 0)
        rss0 = broker.memory_info().rss
        ctx = zmq.Context()
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.RCVHWM, 1)                # it reads nothing: keep what arrives in the broker
        bad.setsockopt(zmq.SNDHWM, N_UNREAD + 10)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(pool.endpoint)
        try:
            for i in range(N_UNREAD):
                bad.send_multipart(wire.encode(wire.Cmd.DESCRIBE, {"rid": i, "cid": "slow"}))
            rows, slowest = make_rows(2, 2), 0.0
            deadline = time.monotonic() + 60

            def all_handled() -> bool:
                nonlocal slowest
                t = time.perf_counter()
                assert len(good.forward(rows).logits) == 2
                slowest = max(slowest, time.perf_counter() - t)
                return good.status()["broker"]["counters"]["frontend_messages"] >= seen + N_UNREAD
            wait_until(all_handled, deadline - time.monotonic(), "the broker did not read the 8,000 requests")
            time.sleep(0.5)
            grown = broker.memory_info().rss - rss0
            counters = good.status()["broker"]["counters"]
            print(f"broker RSS {rss0 / 2**20:.0f} -> {(rss0 + grown) / 2**20:.0f} MiB after {N_UNREAD} unread "
                  f"replies; {counters.get('client_gone', 0)} dropped; slowest other call {slowest * 1e3:.0f} ms")
            assert grown <= GROWTH_LIMIT, f"the broker grew by {grown / 2**20:.0f} MiB"
            assert counters.get("client_gone", 0) > 0, "replies past the client's queue limit must be dropped"
            assert slowest < 2.0, f"another client waited {slowest:.1f} s"
        finally:
            bad.close(0)
            ctx.term()
        assert "the client is gone or not reading its replies" in pool.log()
        assert len(good.forward(make_rows(3, 1)).logits) == 1
