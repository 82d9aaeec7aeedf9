"""Overload and deadlines against a real broker (and a real worker): busy is PoolBusy with the pool's retry-after,
a call never outlives its deadline, work whose caller gave up is dropped unrun (in the broker's queue, or skipped
by the worker before compute) and counted, nothing listening is said within 5 s, and other callers never notice.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SUBPROCESS_ENV, free_port, make_rows, wait_until

from laya_pool.broker.overload import DrainRate, retry_after
from laya_pool.client.errors import PoolBusy, PoolNoWorker, PoolTimeout, PoolUnavailable, PoolUnreachable
from laya_pool.client.local import local_pool
from laya_pool.client.pool import Client
from laya_pool.client.pool_async import AsyncClient
from laya_pool.protocol.contract import CONNECT_TIMEOUT_S, RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, Reason

ROOT = Path(__file__).resolve().parents[1]
SMALL = make_rows(7, 2)
SLACK_S = 0.25          # a call raises at its deadline; this is for a busy machine's scheduling


def _timed(fn):
    t = time.monotonic()
    try:
        fn()
    except PoolUnavailable as e:
        return e, time.monotonic() - t
    pytest.fail("the call was expected to fail")


# ---------------------------------------------------------------------------------------------- pure parts

def test_drain_rate_counts_the_last_window_only():
    d = DrainRate(window_s=5.0, slots=10)
    assert d.rate(100.0) == 0.0
    for i in range(20):                       # 20 requests over 2 s
        d.note(100.0 + i * 0.1)
    assert d.rate(102.0) == pytest.approx(20 / 2.0, rel=0.3)
    assert d.rate(104.9) == pytest.approx(20 / 5.0, rel=0.1)
    assert d.rate(110.0) == 0.0               # all of it is older than the window


def test_retry_after_is_the_queue_over_the_rate_within_bounds():
    assert retry_after(100, 200.0) == pytest.approx(0.5)
    assert retry_after(1, 1e6) == RETRY_AFTER_MIN_S
    assert retry_after(10_000, 1.0) == RETRY_AFTER_MAX_S
    assert retry_after(5, 0.0) == RETRY_AFTER_MAX_S         # nothing drains: look again in a while


# ---------------------------------------------------------------------------------------------- no pool, no worker

def test_nothing_listening_is_said_within_5_s_by_both_clients():
    ep = f"tcp://127.0.0.1:{free_port()}"
    with Client(ep) as c:                                    # defaults: 10 s deadline, 3 retries
        e, took = _timed(c.status)
    assert type(e) is PoolUnreachable and e.reason == Reason.UNREACHABLE
    assert f"{ep}: nothing answered at this endpoint" in str(e), str(e)
    assert CONNECT_TIMEOUT_S - 0.1 <= took < 5.0, took

    async def go():
        async with AsyncClient(ep) as a:
            await a.forward(SMALL)
    e, took = _timed(lambda: asyncio.run(go()))
    assert type(e) is PoolUnreachable and took < 5.0, (e, took)
    print(f"unreachable reported after {took:.2f} s")


@pytest.fixture
def bare_broker(tmp_path):
    """A broker with no worker: `--queue-size 1`."""
    fe, be = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be"
    p = subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend", be,
                          "--queue-size", "1"], env=SUBPROCESS_ENV, cwd=ROOT)
    try:
        with Client(fe, timeout=30, connect_timeout=30) as c:
            c.status()
        yield fe
    finally:
        p.terminate()
        p.wait(20)


def test_no_worker_and_a_full_queue_that_does_not_drain(bare_broker):
    fe = bare_broker
    with Client(fe, timeout=1.0) as c, Client(fe, timeout=2.0) as other, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_timed, lambda: c.forward(SMALL))        # fills the queue (size 1) for ~1 s
        wait_until(lambda: other.status()["broker"]["queue"] == 1, 5, "the first request never queued")
        busy, took = _timed(lambda: other.forward(SMALL))
        # Nothing drains (no worker): the hint is the upper bound, longer than the call's deadline, so the
        # call raises at once instead of sleeping into its deadline.
        assert type(busy) is PoolBusy and busy.reason == Reason.BUSY, busy
        assert busy.retry_after == RETRY_AFTER_MAX_S and took < 0.5, (busy, took)
        # The queued one waited until its deadline (less the margin) and was told why.
        nowork, took = waiting.result()
        assert type(nowork) is PoolNoWorker and nowork.reason == Reason.NO_WORKER, nowork
        assert 0.7 < took <= 1.0, took
        st = other.status()
    assert st["broker"]["queue"] == 0 and st["meter"]["expired"] == {"queue": 1}
    outcomes = st["meter"]["outcomes"]
    assert ["retryable", "busy", 1] in outcomes and ["retryable", "no-worker", 1] in outcomes, outcomes


# ---------------------------------------------------------------------------------------------- a real worker

def test_busy_expired_and_other_callers_on_a_real_pool(tiny_ckpt):
    """One CPU worker holding 2 requests (credit 2), a broker queue of 1. The slow request (the workspace's
    whole capacity, raised to 65,536 tokens) takes ~3.6 s on one thread of the 2-core development machine (16,384
    tokens took 0.9 s there: too close to the 1 s deadline below, and the test could fail), so it stays
    well past every short deadline on a machine a few times faster."""
    slow = make_rows(11, 128, length=512)
    with local_pool(tiny_ckpt, "cpu", extra_args=["--threads", "1", "--credit", "2", "--queue-size", "1",
                                                  "--max-tokens", "65536", "--max-rows", "128"]) as pool, \
            pool.client(timeout=30) as watch, concurrent.futures.ThreadPoolExecutor(4) as run:
        want = watch.forward(slow).flat                        # also warms the shape
        want_small = watch.forward(SMALL).flat

        def settled(expired: int | None = None):
            """The status once the worker's own counts (sent with its heartbeats) caught up with the broker's."""
            st = watch.status()
            w = st["workers"][0]
            caught_up = w["stats"].get("ok") == w["completed"]
            return st if caught_up and (expired is None or w["stats"].get("expired") == expired) else None
        before = wait_until(settled, 5, "the worker's stats never caught up")["workers"][0]["stats"]

        def call(timeout: float, rows):
            with pool.client(timeout=timeout) as c:
                t = time.monotonic()
                try:
                    return c.forward(rows).flat, time.monotonic() - t
                except PoolUnavailable as e:
                    return e, time.monotonic() - t

        def held(inflight: int, queue: int) -> bool:
            st = watch.status()
            return st["workers"][0]["inflight"] == inflight and st["broker"]["queue"] == queue

        s1 = run.submit(call, 30, slow)                        # a caller with time to wait
        wait_until(lambda: held(1, 0), 5, "the slow request never reached the worker")
        # Dispatched to the worker (its second credit) but waiting there behind the slow one: its caller gives
        # up after 0.5 s, and the worker skips it unrun when its turn comes.
        skipped = run.submit(call, 0.5, SMALL)
        wait_until(lambda: held(2, 0), 5, "the short request never reached the worker")
        # The worker is full: the next one waits in the broker's queue (1 of 1) until its deadline ...
        expiring = run.submit(call, 1.0, SMALL)
        wait_until(lambda: held(2, 1), 5, "the request never queued")
        # ... so a caller now is turned away busy, with the pool's hint, within its deadline.
        busy, took = call(0.3, SMALL)
        assert type(busy) is PoolBusy and RETRY_AFTER_MIN_S <= busy.retry_after <= RETRY_AFTER_MAX_S, busy
        assert took <= 0.3 + SLACK_S, took
        e, took = skipped.result()
        assert type(e) is PoolTimeout and e.reason == Reason.TIMEOUT and took <= 0.5 + SLACK_S, (e, took)
        # The queued one is dropped at its deadline (a little before the caller's), and the verdict reaches it.
        e, took = expiring.result()
        assert type(e) is PoolTimeout and e.reason == Reason.EXPIRED and took <= 1.0, (e, took)
        # The caller with time is served, right; so is a new caller once the burst is over.
        flat, slow_s = s1.result()
        assert np.array_equal(flat, want), flat
        assert np.array_equal(watch.forward(SMALL).flat, want_small)

        st = wait_until(lambda: settled(before["expired"] + 1), 5,
                        lambda: f"the worker never counted the skipped request: {watch.status()}")
        stats = st["workers"][0]["stats"]
        # Computed: the slow request and the last small one; the skipped request reached the worker, never ran.
        assert stats["ok"] - before["ok"] == 2 and stats["received"] - before["received"] == 3, (before, stats)
        assert st["meter"]["expired"] == {"worker": 1, "queue": 1}
        outcomes = {(s, r): n for s, r, n in st["meter"]["outcomes"]}
        assert outcomes[("retryable", "expired")] == 2 and outcomes[("retryable", "busy")] >= 1, outcomes
        print(f"slow request {slow_s:.2f} s; busy hint {busy.retry_after:.2f} s "
              f"(drain {st['broker']['drain_per_s']:.2f}/s); expired: {st['meter']['expired']}")
