"""Memory any local peer can reach is bounded in bytes (issue #54), with real brokers, workers and sockets.

- Replies no client reads: bounded in total, not per client (`--unread-max-bytes`, broker/unread.py), and handed back
  to the system once those clients leave. Fifty DEALERs each sending 1,000 STATUS and never reading took a broker
  from 52 to 158 MB, still 129.5 MB after they closed.
- A worker's direct socket takes no frame larger than its capacity holds, and queues a client's requests by bytes
  (worker/inbox.py `direct_limits`): four DEALERs sending 60 MB frames took a worker from 404 to 1,186 MB.
"""
from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
import zmq
from conftest import ROOT, SUBPROCESS_ENV, make_rows, wait_until

from laya_pool.broker.unread import GRACE_S, MESSAGE_COST, SAMPLE_S, TRIM_BYTES, Unread, probe
from laya_pool.client.local import local_pool
from laya_pool.client.pool import Client
from laya_pool.protocol import wire
from laya_pool.worker.inbox import direct_limits

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


class Tracker:
    def __init__(self) -> None:
        self.done = False


def test_the_unread_rule_from_a_table():
    c = MESSAGE_COST                            # what holding a message costs beyond its bytes
    u = Unread(max_bytes=100 + 3 * c)
    a1 = Tracker()
    assert u.admit(b"a", 60, 0.0) and u.mark_due(b"a", 0.0)
    u.add(b"a", 60, 0.0, a1)                    # marked: ZeroMQ will say when it let go of it
    assert not u.mark_due(b"a", 0.01)           # one mark in SAMPLE_S
    u.add(b"a", 40, 0.01)
    assert u.admit(b"a", 1, 0.02)               # past the bound, but a's mark is younger than GRACE_S
    late = Tracker()
    u.probed(late, GRACE_S)                     # a probe made GRACE_S after a's mark, not reported yet: the
    assert u.admit(b"a", 1, 1.0)                # reports run late, so a may have taken it: not judged, however old
    early = Tracker()
    early.done = True
    u.probed(early, GRACE_S - 0.001)            # reported, but made less than GRACE_S after a's mark
    assert u.admit(b"a", 1, 1.0) and u.reported == float("-inf")    # (and behind the late one: not read yet)
    late.done = True
    assert not u.admit(b"a", 1, GRACE_S + 0.001)     # past the bound, a's mark not taken GRACE_S on: not reading
    assert u.reported == GRACE_S
    assert u.admit(b"b", 50, 0.06)              # b holds nothing: its reply goes
    u.add(b"b", 50, 0.06)                       # (not marked: mark_due is the caller's question)
    assert u.total == 150 + 3 * c and u.held(b"a") == 100 + 2 * c
    u.add(b"a", 5, 0.064)
    a1.done = True                              # a took its marked reply: what went before it is counted off
    u.settle(0.065)
    assert u.held(b"a") == 45 + 2 * c and u.held(b"b") == 50 + c
    u.settle(0.065 + SAMPLE_S)                  # nothing marked outstanding and quiet: the rest was taken
    assert u.total == 0 and u.clients == {}
    assert not u.trim_due(1.0)                  # less than TRIM_BYTES went: no trim
    big = Tracker()
    u.add(b"c", TRIM_BYTES, 2.0, big)
    big.done = True
    u.settle(2.0)
    assert u.trim_due(10.0) and not u.trim_due(10.5)  # once, then not again within a second


def test_a_probe_is_reported_after_every_let_go_before_it():
    """The order `Unread` relies on, with pyzmq's own trackers: a sent message that ZeroMQ let go of before a probe
    was made is reported (its tracker done) by the time the probe is."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        b.bind("inproc://probe")
        a.connect("inproc://probe")
        for _ in range(200):
            sent = a.send(zmq.Frame(b"x" * 64, track=True, copy=False), copy=False, track=True)   # (as sockets.py)
            assert not sent.done
            b.recv()                                  # its message let go of here
            p = probe()
            wait_until(lambda p=p: p.done, 10, "the probe was never reported", interval=1e-4)
            assert sent.done
        kept = a.send(zmq.Frame(b"y" * 64, track=True, copy=False), copy=False, track=True)  # not received: held
        p = probe()
        wait_until(lambda: p.done, 10, "the probe was never reported", interval=1e-4)
        assert not kept.done
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def _vm(pid: int, key: str) -> int:
    """VmRSS (now) or VmHWM (the peak since the last reset) of `pid`, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(x for x in f if x.startswith(key + ":")).split()[1]) * 1024


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def test_replies_nobody_reads_are_bounded_in_total_and_given_back_when_they_leave(tmp_path):
    peers, each, bound = 40, 1000, 8 * MiB
    fe, be, log = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be", tmp_path / "broker.log"
    with open(log, "w") as out:
        broker = subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend", be,
                                   "--unread-max-bytes", str(bound)], env=SUBPROCESS_ENV, cwd=ROOT, stdout=out,
                                  stderr=subprocess.STDOUT)
    ctx = zmq.Context()
    socks = []
    try:
        with Client(fe, timeout=30.0, connect_timeout=30.0) as good:
            st = good.status()
            reply = len(wire.pack(st))
            seen = st["broker"]["counters"].get("frontend_messages", 0)
            rss0 = psutil.Process(broker.pid).memory_info().rss
            for _ in range(peers):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.RCVHWM, 1)             # reads nothing: what is sent stays in the broker
                s.setsockopt(zmq.SNDHWM, each + 10)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(fe)
                socks.append(s)
                for rid in range(each):
                    s.send_multipart(wire.encode(wire.Cmd.STATUS, {"rid": rid}))
            slowest = 0.0

            def all_read() -> bool:
                nonlocal slowest
                t = time.perf_counter()
                n = good.status()["broker"]["counters"].get("frontend_messages", 0)
                slowest = max(slowest, time.perf_counter() - t)
                return n >= seen + peers * each
            wait_until(all_read, 60, "the broker did not read every STATUS")
            time.sleep(0.5)
            st = good.status()["broker"]
            grown = psutil.Process(broker.pid).memory_info().rss - rss0
            held = st["unread_reply_bytes"]
            for s in socks:
                s.close(0)
            socks.clear()
            wait_until(lambda: good.status()["broker"]["unread_reply_bytes"] == 0, 10, "the unread count stayed")
            time.sleep(1.5)                                # the next trim (at most one a second)
            after = psutil.Process(broker.pid).memory_info().rss
        print(f"\n{peers} clients x {each} STATUS ({reply} B each) never read: broker RSS {rss0 / MiB:.0f} -> "
              f"{(rss0 + grown) / MiB:.0f} MiB (unread {held / MiB:.1f} MiB, bound {bound / MiB:.0f}), "
              f"{st['counters'].get('unread_full', 0)} dropped; {after / MiB:.0f} MiB once they left; another "
              f"client's slowest status {slowest * 1e3:.0f} ms")
        # Beyond the bound, what each client was sent in its last GRACE_S before it showed it does not read.
        assert held <= 1.5 * bound, f"{held / MiB:.1f} MiB unread"
        assert grown <= 1.5 * bound + 8 * MiB, f"grew {grown / MiB:.0f} MiB"
        assert st["counters"].get("unread_full", 0) > 0 and "--unread-max-bytes" in log.read_text()
        assert slowest < 2.0
        assert after - rss0 <= 6 * MiB, "the memory of the replies must be given back once their clients left"
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        broker.terminate()
        broker.wait(20)


def test_a_direct_socket_takes_no_frame_beyond_the_workers_capacity(tiny_ckpt):
    frame = 60 * MiB
    with local_pool(tiny_ckpt, "cpu", heartbeat_ms=250, liveness=4, extra_args=["--threads", "1"],
                    env={"LAYA_DATA_REQUESTS": "on", "LAYA_DIRECT": "on"}) as pool, \
            Client(pool.endpoint, timeout=10.0) as c:
        w = c.status()["workers"][0]
        cap = w["capacity"]
        largest = wire.request_bytes(cap["max_rows"], cap["max_tokens"], cap["max_markers"])
        max_frame, hwm = direct_limits(largest)
        assert max_frame < MiB and hwm * (wire.MAX_HEADER_BYTES + largest) <= 8 * MiB
        rows = make_rows(5, n=2)
        want = c.forward(rows).flat
        _reset_peak(w["pid"])
        rss0 = _vm(w["pid"], "VmRSS")
        ctx = zmq.Context()
        body = bytes(frame)
        head = wire.encode(wire.Cmd.REQUEST, {"rid": 1, "cid": "x", "rows": 1, "tokens": 1, "markers": 1})[0]
        try:
            for _ in range(4):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(w["direct"])
                for _ in range(4):
                    s.send_multipart([head, body], copy=False)
            time.sleep(3.0)                                # what a worker reads of 16 x 60 MB
        finally:
            ctx.destroy(0)
        grown = _vm(w["pid"], "VmHWM") - rss0
        print(f"\n16 frames of 60 MB at a direct socket (largest taken {max_frame:,} B, {hwm} a client queued): "
              f"worker peak RSS +{grown / MiB:.1f} MiB")
        assert grown < 32 * MiB
        assert (c.forward(rows).flat == want).all() and c.status()["workers"][0]["pid"] == w["pid"]


def test_an_asyncio_clients_requests_message_stays_within_a_direct_sockets_frame():
    from laya_pool.client.direct_async import TOGETHER, _parts
    # (buffer sizes, the bytes a message may hold) -> [start, end) of each message
    assert _parts([10] * 5, 25) == [(0, 2), (2, 4), (4, 5)]
    assert _parts([10] * (TOGETHER + 6), 1 << 30) == [(0, TOGETHER), (TOGETHER, TOGETHER + 6)]
    assert _parts([30, 5, 5], 20) == [(0, 1), (1, 3)]          # one larger than the limit goes alone
    assert _parts([], 5) == []


def test_the_brokers_receive_queues_are_sized_in_bytes(tmp_path):
    """What one peer's unread messages may hold on each broker socket: its queue's count times its largest message,
    within PEER_BUFFER_BYTES unless that leaves fewer than MIN_RCVHWM messages."""
    from laya_pool.broker.broker import Broker, BrokerConfig
    from laya_pool.broker.sockets import MIN_RCVHWM, PEER_BUFFER_BYTES
    b = Broker(BrokerConfig(frontend=f"ipc://{tmp_path}/fe", backend=f"ipc://{tmp_path}/be", operator_secret=False))
    try:
        for sock, frame in ((b.frontend, b.cfg.max_frontend_bytes), (b.backend, b.cfg.max_backend_bytes)):
            hwm = sock.getsockopt(zmq.RCVHWM)
            assert sock.getsockopt(zmq.MAXMSGSIZE) == frame
            held = hwm * (wire.MAX_HEADER_BYTES + frame)
            assert held <= PEER_BUFFER_BYTES or hwm == MIN_RCVHWM, (hwm, frame)
            print(f"\nRCVHWM {hwm} x {frame / MiB:.0f} MiB frames: {held / MiB:.0f} MiB a peer")
    finally:
        b.shutdown()
