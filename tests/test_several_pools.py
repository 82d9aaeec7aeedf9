"""Clients of several pools (client/pools.py): `Client([ep1, ep2])` and `AsyncClient([...])`.

The choice and the bookkeeping are tested alone, with stand-in clients; then two whole pools (each `laya-pool up` with
a CPU worker, on loopback addresses of their own) behind one blocking and one asyncio client: one pool is killed
(SIGKILL: its supervisor, broker and worker at once) under load, and no call fails.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ROOT, SUBPROCESS_ENV, LoadThreads, free_port, make_rows, reference_logits, wait_until

from laya_pool import AsyncClient, Client, PoolBusy, PoolError, PoolTimeout, PoolUnavailable, PoolUnreachable
from laya_pool.client import pools
from laya_pool.client.errors import RequestFailed
from laya_pool.client.pools import AsyncPools, Member, Pools, Spread


def _member(endpoint: str, up: bool = True) -> Member:
    return Member(endpoint, SimpleNamespace(_watch=SimpleNamespace(up=up)))


# ------------------------------------------------------------------------------------------------ the choice

def test_a_call_goes_to_the_pool_with_the_fewest_calls_out_and_ties_take_turns():
    a, b, c = _member("a"), _member("b"), _member("c")
    spread = Spread([a, b, c])
    first = [spread.take([])[0].endpoint for _ in range(3)]
    assert sorted(first) == ["a", "b", "c"]              # one call out on each
    m, token = spread.take([])
    assert len(m.inflight) == 2
    spread.done(m, token, failed=False)
    for x in (a, b, c):
        x.inflight.clear()
    b.inflight.add(99)
    turns = [spread.take([])[0].endpoint for _ in range(2)]
    assert sorted(turns) == ["a", "c"]                   # b holds one more than a and c


def test_a_failed_pool_is_tried_last_until_it_is_connected_again(monkeypatch):
    a, b = _member("a"), _member("b")
    spread = Spread([a, b])
    failed, token = spread.take([])
    other = b if failed is a else a
    spread.done(failed, token, failed=True)
    for _ in range(4):
        got, t = spread.take([])
        assert got is other                            # however many calls the other holds
        spread.done(got, t, failed=False)
    last, t = spread.take([other])                     # ... but a call the other failed still tries it
    assert last is failed
    spread.done(last, t, failed=True)
    monkeypatch.setattr(pools, "HOLD_S", 0.0)
    failed.client._watch.up = False
    assert not failed.healthy(time.monotonic())        # its hold is over, but it has no connection
    failed.client._watch.up = True
    assert failed.healthy(time.monotonic())
    got, t = spread.take([other])
    spread.done(got, t, failed=False)                  # an answer clears it
    assert got is failed and failed.failed_at is None


def test_each_try_gets_an_equal_share_of_what_is_left():
    deadline = time.monotonic() + 10.0
    assert 4.9 < pools.share(deadline, 2) <= 5.0
    assert 9.9 < pools.share(deadline, 1) <= 10.0
    assert pools.share(time.monotonic() - 1, 1) == pytest.approx(1e-3)


def test_errors_name_their_pool():
    e = pools.named(PoolTimeout("tcp://a:1: no answer", last="no reply", attempts=2, reason="timeout"), "tcp://a:1")
    assert e.pool == "tcp://a:1" and str(e).startswith("tcp://a:1")
    r = pools.named(RequestFailed("too many rows", field="rows", row=3, worker="0", reason="bad-request"), "tcp://b:2")
    assert (str(r), r.field, r.row, r.worker, r.pool) == ("tcp://b:2: too many rows", "rows", 3, "0", "tcp://b:2")
    both = pools.all_failed([("tcp://a:1", PoolUnreachable("tcp://a:1: nothing answered", attempts=1)),
                             ("tcp://b:2", PoolUnreachable("tcp://b:2: nothing answered", attempts=2))])
    assert isinstance(both, PoolUnreachable) and both.attempts == 3 and both.pool == "tcp://a:1, tcp://b:2"
    assert "tcp://a:1: nothing answered" in str(both) and "tcp://b:2: nothing answered" in str(both)
    mixed = pools.all_failed([("a", PoolBusy("a: busy", retry_after=0.5)), ("b", PoolTimeout("b: silent"))])
    assert type(mixed) is PoolUnavailable


def test_status_of_several_pools_names_each_and_holder_finds_a_worker():
    st = pools.status_of([("tcp://a:1", {"workers": [{"id": "0", "state": "ready"}], "broker": {"pid": 1}}),
                          ("tcp://b:2", PoolUnreachable("tcp://b:2: nothing answered", reason="unreachable"))])
    assert st["workers"] == [{"id": "0", "state": "ready", "pool": "tcp://a:1"}]
    assert st["pools"] == [{"pool": "tcp://a:1", "broker": {"pid": 1}},
                           {"pool": "tcp://b:2", "error": "tcp://b:2: nothing answered", "reason": "unreachable"}]
    assert pools.holder(st, "0") == "tcp://a:1"
    with pytest.raises(RequestFailed, match="no pool lists it"):
        pools.holder(st, "7")
    with pytest.raises(PoolUnreachable):
        pools.status_of([("a", PoolUnreachable("a: x")), ("b", PoolUnreachable("b: y"))])


def test_one_endpoint_is_todays_client_and_several_are_a_client_of_pools():
    for one in ("tcp://127.0.0.1:9", ["tcp://127.0.0.1:9"], ("tcp://127.0.0.1:9",)):
        c = Client(one, timeout=1)
        assert type(c) is Client and c.endpoint == "tcp://127.0.0.1:9"
        c.close()
    c = Client(["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"], timeout=1)
    assert type(c) is Pools and isinstance(c, Client) and c.endpoints == ["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"]
    c.close()
    a = AsyncClient(["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"])
    assert type(a) is AsyncPools and isinstance(a, AsyncClient)
    a.close()
    with pytest.raises(ValueError, match="twice"):
        Client(["tcp://127.0.0.1:9", "tcp://127.0.0.1:9"])
    with pytest.raises(ValueError, match="endpoint"):
        Client([])


def test_no_pool_listening_is_one_error_naming_both_within_the_deadline():
    eps = [f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"]
    with Client(eps, timeout=1.0, retries=2) as c:
        t = time.monotonic()
        with pytest.raises(PoolUnavailable) as e:
            c.ping()
        assert time.monotonic() - t < 1.6
    assert all(ep in str(e.value) for ep in eps) and e.value.pool


# ------------------------------------------------------------------------------------------------ two pools, one killed

HB_MS = 200


def _start_pool(ckpt, frontend: str, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "laya_pool", "up", "--model", str(ckpt), "--devices", "cpu",
                             "--frontend", frontend, "--heartbeat-ms", str(HB_MS), "--threads", "1"],
                            env=SUBPROCESS_ENV, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _answered(st: dict) -> int:
    """Requests the pool's workers answered ok, whichever way they came."""
    return sum(w.get("stats", {}).get("ok", 0) for w in st["workers"])


class _Load(LoadThreads):
    """A blocking client of both pools in threads, and an asyncio one with calls in flight together, each answer
    checked against the runtime, until stopped."""

    JOIN_S = 30.0

    def __init__(self, endpoints: list[str], cases: list, want: list):
        self.endpoints, self.cases, self.want = endpoints, cases, want
        self.stop = threading.Event()
        self.clients: list = []
        self.answers = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._blocking, daemon=True) for _ in range(2)]
        self.threads.append(threading.Thread(target=lambda: asyncio.run(self._asyncio()), daemon=True))

    def _check(self, i: int, res) -> None:
        np.testing.assert_allclose(res.flat, self.want[i], rtol=1e-5, atol=1e-5)
        self.answers += 1

    def _blocking(self) -> None:
        with Client(self.endpoints, timeout=10.0) as c:
            self.clients.append(c)
            i = 0
            while not self.stop.is_set():
                try:
                    self._check(i % 3, c.forward(self.cases[i % 3]))
                except Exception as e:  # noqa: BLE001 - every failure is the test's
                    self.errors.append(repr(e))
                i += 1

    async def _asyncio(self) -> None:
        c = AsyncClient(self.endpoints, timeout=10.0)
        self.clients.append(c)

        async def loop(k: int) -> None:
            i = k
            while not self.stop.is_set():
                try:
                    self._check(i % 3, await c.forward(self.cases[i % 3]))
                except Exception as e:  # noqa: BLE001
                    self.errors.append(repr(e))
                i += 1
        try:
            await asyncio.gather(*(loop(k) for k in range(3)))
        finally:
            c.close()


@pytest.mark.timeout(120)
def test_two_pools_behind_one_client_one_killed_under_load_fails_no_call(tiny_ckpt, tiny_runtime, tmp_path):
    endpoints = [f"tcp://127.0.0.5:{free_port()}", f"tcp://127.0.0.6:{free_port()}"]
    logs = [open(tmp_path / f"pool{i}.log", "wb") for i in range(2)]
    procs = [_start_pool(tiny_ckpt, ep, log) for ep, log in zip(endpoints, logs)]
    cases = [make_rows(300 + i, 2, length=40) for i in range(3)]
    want = [reference_logits(tiny_runtime, r) for r in cases]
    try:
        with Client(endpoints, timeout=2.0, retries=0) as c:
            wait_until(lambda: sum(w["state"] == "ready" for w in c.status()["workers"]) == 2, 90,
                       "the two pools did not get ready", interval=0.3, ignore=(PoolError,))
            before = c.status()
        assert {w["pool"] for w in before["workers"]} == set(endpoints)
        doomed, kept = endpoints
        with Client(doomed, timeout=2.0) as a, Client(kept, timeout=2.0) as b, _Load(endpoints, cases, want) as load:
            # Both pools answer this client's calls.
            wait_until(lambda: not load.errors and _answered(a.status()) >= 6 and _answered(b.status()) >= 6, 60,
                       lambda: f"the calls were not spread over both pools: {load.errors[:2]}")
            st = a.status()
            pids = [procs[0].pid, st["broker"]["pid"], *(w["pid"] for w in st["workers"])]
            for pid in pids:                 # the whole pool at once, as a host that is lost
                os.kill(pid, signal.SIGKILL)
            n = load.answers
            # Calls out on the killed pool go to the other within their deadline (after at most connect_timeout).
            wait_until(lambda: not load.errors and load.answers >= n + 30, 60,
                       lambda: f"the client did not carry on with the other pool: {load.errors[:3]}")
            time.sleep(1.0)
        assert not load.errors, load.errors[:3]
        # Calls were out on the killed pool (both clients' kinds) and went to the other: failed over, not failed.
        assert all(c.spread.failed_over >= 1 for c in load.clients), [c.spread.failed_over for c in load.clients]
        with Client(endpoints, timeout=2.0, retries=0) as c:
            after = c.status()
        assert [p["pool"] for p in after["pools"]] == endpoints
        assert "error" in after["pools"][0] and doomed in after["pools"][0]["error"]
        assert {w["pool"] for w in after["workers"]} == {kept}
    finally:
        procs[0].kill()
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(30) == 0
        for log in logs:
            log.close()
