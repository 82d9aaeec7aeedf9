"""BUNDLEs and REQUESTS through a live pool (real processes and sockets, the tiny model on the CPU): an asyncio
client's direct requests of one event-loop turn travel in one message, a worker answers its requests of one forward in
one message, and every call still gets its own answer.

The pool's one worker merges up to 8 requests a forward (a CPU worker merges only when asked) and takes requests on
its direct socket, without lanes (a lane carries one request at a time, which a bundle never holds).
"""
import asyncio

import numpy as np
import pytest
from conftest import make_rows, wait_until

from laya_pool.client.local import local_pool
from laya_pool.client.pool_async import AsyncClient

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pool(tiny_ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("bundles") / "pool.log"
    env = {"LAYA_DATA_REQUESTS": "on", "LAYA_DIRECT": "on", "LAYA_LANES": "off"}
    with local_pool(tiny_ckpt, "cpu", startup_timeout=180, log=log, env=env,
                    extra_args=["--max-batch", "8", "--credit", "64"]) as p:
        yield p
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def runtime(tiny_ckpt):
    import torch

    from laya_pool.worker.checkpoint import load_checkpoint
    from laya_pool.worker.runtime import Runtime
    torch.set_num_threads(1)
    return Runtime(load_checkpoint(tiny_ckpt), device="cpu")


def _counts(pool, ok: int = 0) -> dict:
    """The worker's counters once its heartbeat reports at least `ok` answered (stats travel with heartbeats)."""
    def stats():
        (w,) = pool.status()["workers"]
        return w["stats"] if w["stats"].get("ok", -1) >= ok else None
    return wait_until(stats, 30, "the worker's stats never caught up")


def _calls(n: int) -> list:
    """n different requests: 1-3 rows of differing lengths and marker counts, so that answers handed to the wrong
    call could not pass for their own (other sizes, other values)."""
    return [make_rows(100 + i, n=1 + i % 3, length=(20, 60)) for i in range(n)]


def test_an_asyncio_clients_replies_come_bundled_and_each_call_gets_its_own(pool, runtime):
    from laya_pool.worker.batch import Batch
    calls = _calls(96)
    before = _counts(pool)

    async def go():
        async with AsyncClient(pool.endpoint, timeout=60, direct=True, together=True) as c:
            await c.forward(calls[0])               # the route table, and the connection to the worker
            await asyncio.sleep(0.2)
            await c.forward(calls[1])               # a reply on the route: its worker takes REQUESTS
            return await asyncio.gather(*(c.forward(rows) for rows in calls)), c._routes.sent

    results, sent_direct = asyncio.run(go())
    after = _counts(pool, before["ok"] + len(calls) + 2)
    bundles, bundled = after["bundles"] - before["bundles"], after["bundled"] - before["bundled"]
    together = after["requests_messages"] - before["requests_messages"]
    assert sent_direct >= len(calls) // 2, sent_direct
    assert bundles >= 1 and bundled >= 2 * bundles, (bundles, bundled)
    assert 1 <= together and after["direct"] - before["direct"] >= 2 * together, (together, after["direct"])
    for rows, res in zip(calls, results):
        want = runtime.run(Batch.from_rows(rows))
        assert [len(x) for x in res.logits] == [len(r[1]) for r in rows]
        # (merged on the CPU, answers move in the 6th decimal: CPU GEMMs are not batch-invariant)
        np.testing.assert_allclose(np.concatenate(res.logits), want.logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(res.act, want.act, rtol=1e-4, atol=1e-5)
        assert res.worker == "0" and res.metrics["batched"] >= 1 and "queue_ms" in res.metrics
    print(f"\n{len(calls)} calls: {together} REQUESTS messages; {bundles} bundles held {bundled} replies")


def test_a_client_that_does_not_ask_gets_no_bundle(pool):
    """The synchronous client, the broker's path and an asyncio client with `bundles=False` never say they read
    bundles: their replies come alone, as before bundles existed, even with calls out together (which, sent together,
    still travel in REQUESTS messages); with `together=False` too, each request travels alone."""
    before = _counts(pool)
    calls = _calls(48)
    with pool.client(timeout=60, direct=False) as c:
        for rows in calls[:12]:
            c.forward(rows)

    async def go(together: bool):
        async with AsyncClient(pool.endpoint, timeout=60, direct=True, bundles=False, together=together) as c:
            await c.forward(calls[0])
            await asyncio.sleep(0.2)
            await c.forward(calls[1])
            await asyncio.gather(*(c.forward(rows) for rows in calls))
            return c._routes.sent

    assert asyncio.run(go(True)) >= len(calls) // 2
    middle = _counts(pool, before["ok"] + 12 + len(calls) + 2)
    assert middle["merged_runs"] > before["merged_runs"]         # calls were out together, and ran together
    assert (middle["bundles"], middle["bundled"]) == (before["bundles"], before["bundled"])
    assert middle["requests_messages"] > before["requests_messages"]
    assert asyncio.run(go(False)) >= len(calls) // 2
    after = _counts(pool, middle["ok"] + len(calls) + 2)
    assert (after["bundles"], after["requests_messages"]) == (middle["bundles"], middle["requests_messages"])


def test_no_requests_go_together_to_a_worker_that_has_not_said_it_takes_them(pool, monkeypatch):
    """A worker older than REQUESTS would refuse one, and its calls would wait out their timeouts: a client sends a
    route REQUESTS only after a reply on it said `together`. Here the client looks for another flag, as if the worker
    never said so: every request goes alone, and every call is answered."""
    from laya_pool.protocol import wire
    monkeypatch.setattr(wire, "TOGETHER", "together-from-a-later-release")
    before = _counts(pool)
    calls = _calls(32)

    async def go():
        async with AsyncClient(pool.endpoint, timeout=60, direct=True, together=True) as c:
            await c.forward(calls[0])
            await asyncio.sleep(0.2)
            await c.forward(calls[1])
            return await asyncio.gather(*(c.forward(rows) for rows in calls))

    assert len(asyncio.run(go())) == len(calls)
    after = _counts(pool, before["ok"] + len(calls) + 2)
    assert after["requests_messages"] == before["requests_messages"]
    assert after["bundles"] > before["bundles"]      # (replies still come bundled: that is the client's ask)


def test_requests_together_are_answered_one_by_one_and_a_bad_one_alone(pool, runtime):
    """What a client sends in one REQUESTS message the worker takes as if each had come alone: a request with a token
    outside the vocabulary is refused naming `ids` and its row, the others answered (bundled: this raw client asks
    for it); a REQUESTS whose buffer does not add up is refused, each of its requests told why; the worker serves on."""
    import zmq

    from laya_pool.protocol import wire
    from laya_pool.protocol.wire import Cmd
    from laya_pool.worker.batch import Batch

    (w,) = pool.status()["workers"]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(w["direct"])

    def replies(n: int) -> dict:
        got = {}
        while len(got) < n and sock.poll(30_000):
            msg = wire.decode(sock.recv_multipart())
            for m in (wire.unbundle(msg) if msg.cmd == Cmd.BUNDLE else [msg]):
                got[m.header["rid"]] = m
        return got

    try:
        calls = _calls(6)
        bad = [(np.array([5, 10**7, 7], np.int32), np.array([1], np.int32), 0)]
        frames = [wire.with_bundles(wire.encode_request(i, wire.pack_rows(rows), cid="raw"))
                  for i, rows in enumerate(calls[:3] + [bad] + calls[3:])]
        sock.send_multipart(wire.requests_message(frames))
        got = replies(7)
        assert sorted(got) == list(range(7)), sorted(got)
        refused = got[3].header
        assert refused["status"] == "final" and refused["error"]["field"] == "ids" and refused["error"]["row"] == 0
        for i, rows in enumerate(calls[:3] + [None] + calls[3:]):
            if rows is None:
                continue
            rep = wire.parse_reply(got[i])
            np.testing.assert_allclose(rep.logits, runtime.run(Batch.from_rows(rows)).logits, rtol=1e-4, atol=1e-4)
        broken = [bytes(f) for f in wire.requests_message(frames[:2])]
        broken[1] = broken[1][:-4]
        sock.send_multipart(broken)
        told = replies(2)
        assert {(m.header["rid"], m.header["status"], m.header["error"]["field"]) for m in told.values()} == \
            {(0, "final", "arrays"), (1, "final", "arrays")}
        sock.send_multipart(frames[0])
        assert wire.parse_reply(replies(1)[0]).status == "ok"            # and it serves on
    finally:
        sock.close(0)


def test_kill_9_while_bundles_and_requests_are_out_loses_nothing(pool, runtime):
    """kill -9 of the worker while an asyncio client's requests go to it together and come back bundled: what was on
    its connection is sent again through the broker, which holds it until the supervisor's new worker is ready; every
    call gets its own right answer, none is lost. (Runs last: the pool's worker is a new process after it.)"""
    import os
    import signal

    from laya_pool.worker.batch import Batch
    calls = _calls(24)
    want = [runtime.run(Batch.from_rows(rows)) for rows in calls]
    (w,) = pool.status()["workers"]
    errors: list = []

    async def go():
        async with AsyncClient(pool.endpoint, timeout=90, retries=8, direct=True, together=True) as c:
            await c.forward(calls[0])
            await asyncio.sleep(0.2)
            await c.forward(calls[1])

            async def one(i):
                try:
                    res = await c.forward(calls[i % len(calls)])
                    np.testing.assert_allclose(np.concatenate(res.logits), want[i % len(calls)].logits, rtol=1e-4,
                                               atol=1e-4)
                except Exception as e:  # noqa: BLE001 - every failure is a test failure
                    errors.append(repr(e))
            killer = asyncio.get_running_loop().call_later(0.05, os.kill, w["pid"], signal.SIGKILL)
            await asyncio.gather(*(one(i) for i in range(192)))
            killer.cancel()
            return c._routes.dropped

    dropped = asyncio.run(go())
    assert not errors, errors[:3]
    assert dropped >= 1, dropped
    wait_until(lambda: [x for x in pool.status()["workers"] if x["state"] == "ready" and x["pid"] != w["pid"]], 120,
               "the worker never came back")
