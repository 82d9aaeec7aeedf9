"""Dynamic batching: queued requests merged into one forward, each answered on its own.

CPU GEMMs are not batch-invariant, so on the CPU a merged answer is compared within 1e-4 of the same
request run alone (the gpu test in test_runtime_gpu.py asks for byte equality on CUDA).
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import make_rows

from laya_pool.client.errors import RequestFailed
from laya_pool.client.local import local_pool
from laya_pool.client.pool_async import AsyncClient
from laya_pool.worker.batch import Batch
from laya_pool.worker.checkpoint import load_checkpoint
from laya_pool.worker.merge import Group
from laya_pool.worker.runtime import Runtime
from laya_pool.worker.workspace import Capacity

pytestmark = pytest.mark.timeout(240)


def _rows(seed: int, n: int) -> list:
    return make_rows(seed, n, length=(8, 120), markers=(1, 6))


def test_group_packs_and_splits_requests_in_order(tiny_ckpt):
    parts = [Batch.from_rows(_rows(10 + i, 1 + i % 3)) for i in range(5)]
    g = Group()
    for b in parts:
        g.add(b)
    merged = g.merged()
    assert merged.rows == sum(b.rows for b in parts) and merged.tokens == sum(b.tokens for b in parts)
    rt = Runtime(load_checkpoint(tiny_ckpt), device="cpu", mode="eager")
    res = rt.run(merged)
    for b, (logits, act) in zip(parts, g.split(res.logits, res.act)):
        alone = rt.run(b)
        assert logits.shape == alone.logits.shape and act.shape == alone.act.shape
        np.testing.assert_allclose(logits, alone.logits, atol=1e-4)
        np.testing.assert_allclose(act, alone.act, atol=1e-4)


def test_group_admits_within_capacity_only():
    b = Batch.from_rows(_rows(2, 3))
    g = Group()
    cap = Capacity(max_tokens=2 * b.tokens, max_rows=64, max_markers=2048)
    assert g.admits(b, cap)
    g.add(b)
    assert g.admits(b, cap)
    g.add(b)
    assert not g.admits(b, cap), "a third copy would overflow max_tokens"
    assert not Group().admits(b, Capacity(max_tokens=4096, max_rows=2, max_markers=2048))


def test_pool_merges_queued_requests_and_fails_a_bad_one_alone(tiny_ckpt):
    requests = [_rows(100 + i, 1 + i % 2) for i in range(48)]
    bad, faulty = 17, 29
    requests[bad] = [(np.array([5, 6, 99999, 7], np.int32), np.array([1, 2], np.int32), 0)]
    requests[faulty] = _rows(99, 7)     # LAYA_WORKER_FAULT_ROWS=7: its run raises inside the worker

    async def burst(endpoint):
        async with AsyncClient(endpoint, timeout=30.0, retries=2) as c:
            return await asyncio.gather(*(c.forward(r) for r in requests), return_exceptions=True)

    async def one_by_one(endpoint):
        async with AsyncClient(endpoint, timeout=30.0, retries=2) as c:
            return [await c.forward(r) for i, r in enumerate(requests) if i not in (bad, faulty)]

    with local_pool(tiny_ckpt, devices="cpu", extra_args=["--max-batch", "8", "--threads", "1"],
                    env={"LAYA_WORKER_FAULT_ROWS": "7"}) as pool:
        merged = asyncio.run(burst(pool.endpoint))
        alone = asyncio.run(one_by_one(pool.endpoint))
        stats = pool.status()["workers"][0]
    err = merged[bad]
    assert isinstance(err, RequestFailed) and err.field == "ids" and err.row == 0, err
    # A failure inside the run of a merged group is retried member by member: only its owner fails.
    fault = merged[faulty]
    assert isinstance(fault, RequestFailed) and "injected fault" in str(fault), fault
    good = [r for i, r in enumerate(merged) if i not in (bad, faulty)]
    assert all(not isinstance(r, Exception) for r in good), [r for r in good if isinstance(r, Exception)][:1]
    sizes = [r.metrics["batched"] for r in good]
    assert max(sizes) > 1, f"nothing was merged: {sizes}"
    assert max(sizes) <= 8
    assert all(r.metrics["batched"] == 1 for r in alone)
    for m, a in zip(good, alone):
        np.testing.assert_allclose(m.flat, a.flat, atol=1e-4)
        np.testing.assert_allclose(m.act, a.act, atol=1e-4)
    assert stats["credit"] == 16, "the credit follows the merge size"


def _with(b: Batch, **arrays: np.ndarray) -> Batch:
    return Batch(**{**b.arrays(), **arrays})


def test_a_groups_values_are_checked_once_and_a_bad_member_is_refused_as_alone(tiny_ckpt):
    """The worker checks each request's structure on arrival and the values of a whole group at once (one
    `check_values` a group). A group with bad members is checked member by member: each bad one is refused with the
    field and row it gets alone (`Runtime.check`), the rest are answered, and nothing bad reaches the forward."""
    from compute_driver import Driven, queued, rows

    from laya_pool.worker.batch import RequestError
    from laya_pool.worker.runtime import RuntimeConfig

    rt = Runtime(load_checkpoint(tiny_ckpt), config=RuntimeConfig(capacity=Capacity(
        max_tokens=4096, max_rows=64, max_markers=1024, row_markers=8)))
    rng = np.random.default_rng(5)
    batches = [rows(rng, 3, 40, 3) for _ in range(16)]
    b = batches
    bad = {
        2: _with(b[2], ids=np.where(np.arange(b[2].tokens) == 95, 10**6, b[2].ids).astype(np.int32)),   # row 2
        5: _with(b[5], lengths=np.array([40, 0, 80], np.int32)),                        # a row of length 0
        6: _with(b[6], types=np.array([0, 0, 7], np.int32)),                             # question type 7
        9: _with(b[9], markers=np.concatenate([b[9].markers[:3], [39, 39, 1], b[9].markers[6:]]).astype(np.int32)),
        12: _with(b[12], markers=np.concatenate([b[12].markers[:8], [45]]).astype(np.int32)),   # past row 2's end
        13: _with(b[13], marker_counts=np.array([1, 1, 9], np.int32),
                  markers=np.concatenate([[1], [2], np.arange(10, 19)]).astype(np.int32)),  # 9 > 8 a row
        14: _with(b[14], lengths=np.array([40, 40, 41], np.int32)),                      # structure: refused on arrival
    }
    batches = [bad.get(i, x) for i, x in enumerate(batches)]
    expected = {}
    for i, x in bad.items():
        with pytest.raises(RequestError) as e:
            rt.check(x)
        expected[i] = (e.value.field, e.value.row)
    assert len(set(expected.values())) == len(bad), f"the planted errors must differ: {expected}"
    checks = []
    check_values = rt.check_values
    rt.check_values = lambda batch: (checks.append(batch.rows), check_values(batch))[1]

    d = Driven(rt, max_group=8)
    good = d.run([queued(i, x) for i, x in enumerate(batches) if i not in bad])
    assert len(checks) == len(good) // 8 + bool(len(good) % 8), f"one values check a group: {checks}"
    assert all(r.status == "ok" for r in good.values())

    checks.clear()
    answers = d.run([queued(i, x) for i, x in enumerate(batches)])
    for i, reply in answers.items():
        if i in bad:
            assert reply.status == "final" and (reply.error["field"], reply.error.get("row")) == expected[i], i
        else:
            assert reply.status == "ok", (i, reply.error)
            np.testing.assert_allclose(reply.logits, good[i].logits, atol=1e-4)
    assert d.counts["request_errors"] == len(bad) and d.counts["internal_errors"] == 0


def test_a_host_error_in_a_groups_check_refuses_only_its_owner(tiny_ckpt):
    """Whatever the group's value check raises is host work: it is found member by member and refused as that
    request's internal error; the rest of the group is answered and the worker goes on (never a device fault)."""
    from compute_driver import Driven, queued, rows

    rt = Runtime(load_checkpoint(tiny_ckpt))
    rng = np.random.default_rng(6)
    batches = [rows(rng, 2, 30, 2) for _ in range(8)]
    owner = batches[3]
    check_values = rt.check_values

    def check(batch: Batch) -> None:
        if np.isin(owner.ids, batch.ids).all() and batch.tokens >= owner.tokens:
            raise RuntimeError("planted host fault")
        check_values(batch)
    rt.check_values = check
    d = Driven(rt, max_group=8)
    answers = d.run([queued(i, b) for i, b in enumerate(batches)])
    assert answers[3].status == "final" and "planted host fault" in answers[3].message
    assert all(answers[i].status == "ok" for i in range(8) if i != 3)
    # the others still share one forward (a failing run would have sent each alone: `_recover`)
    assert {answers[i].metrics["batched"] for i in range(8) if i != 3} == {7}
    assert d.counts["internal_errors"] == 1 and d.compute.fatal is None


def test_waste_is_the_padding_a_request_adds_beyond_its_own():
    short, long = Batch.from_rows(make_rows(1, 4, length=(16, 17))), Batch.from_rows(make_rows(2, 4, length=(200, 201)))
    g = Group([short])
    assert g.waste(Batch.from_rows(make_rows(3, 4, length=(16, 17)))) == 0
    assert g.waste(long) == 8 * 200 - 4 * 16 - 4 * 200          # the short rows padded to 200
    g = Group([long])
    assert g.waste(short) == 4 * (200 - 16)                      # the same padding, whichever came first
    g.add(short)
    assert (g.row_len, g.area) == (200, 4 * 200 + 4 * 16)
    # Where graphs are cached by bucket, rows of one 16-token step pad alike: 33 and 48 waste nothing together.
    a, b = Batch.from_rows(make_rows(4, 4, length=(33, 34))), Batch.from_rows(make_rows(5, 4, length=(48, 49)))
    assert Group([a], step=16).waste(b) == 0 and Group([a]).waste(b) == 4 * (48 - 33)


def _launched_lengths(rt: Runtime) -> list[list[int]]:
    """Wrap rt.launch to record each launched group's row lengths."""
    seen: list[list[int]] = []
    launch = rt.launch

    def recording(batch, *a, **kw):
        seen.append(batch.lengths.tolist())
        return launch(batch, *a, **kw)
    rt.launch = recording
    return seen


@pytest.mark.parametrize("waste, groups", [(512, [[16, 17, 18], [200, 201]]), (None, [[16, 200, 17, 201, 18]])],
                         ids=["bounded", "unbounded"])
def test_a_request_that_would_pad_a_group_waits_first_in_line(tiny_ckpt, waste, groups):
    """Queued in the order 16, 200, 17, 201, 18 (tokens a row, four rows each): with the bound, the long requests
    are set aside by the first group and form the next, in order, and every request is answered (the stop
    sentinel came before the second group formed); without it, one group pads all twenty rows to 201."""
    from compute_driver import Driven, queued

    rt = Runtime(load_checkpoint(tiny_ckpt))
    seen = _launched_lengths(rt)
    rng = np.random.default_rng(9)
    batches = [Batch.from_rows([(rng.integers(5, 900, n).astype(np.int32), np.array([1, 3], np.int32), 0)
                                for _ in range(4)]) for n in (16, 200, 17, 201, 18)]
    d = Driven(rt, max_group=8, merge_waste=waste)
    answers = d.run([queued(i, b) for i, b in enumerate(batches)])
    assert all(a.status == "ok" for a in answers.values())
    assert [sorted(set(g), key=g.index) for g in seen] == groups
    assert d.counts["set_aside"] == (2 if waste else 0) and not d.compute.waiting


def test_what_waits_goes_first_and_stays_in_arrival_order(tiny_ckpt):
    """Two requests set aside before (400 and 200 tokens a row) and two new arrivals (16 and 201): the waiting ones
    are offered first, the 201-token one joins the 200-token group, and what is set aside again stays ahead of the
    new arrival set aside after it (the 400 before the 16)."""
    from compute_driver import Driven, queued

    rt = Runtime(load_checkpoint(tiny_ckpt))
    rng = np.random.default_rng(10)
    reqs = {n: queued(n, Batch.from_rows([(rng.integers(5, 900, n).astype(np.int32), np.array([1, 3], np.int32), 0)
                                          for _ in range(4)])) for n in (200, 400, 16, 201)}
    c = Driven(rt, max_group=8).compute
    c.waiting.extend([reqs[200], reqs[400]])
    for n in (16, 201):
        c.inbox.put(reqs[n])
    first = c.waiting.popleft()
    members, group, stop = c.take_group(first)
    assert [q.req.rid for q in members] == [200, 201] and not stop
    assert [q.req.rid for q in c.waiting] == [400, 16]
    assert c.counts["set_aside"] == 2


def test_what_waits_is_handed_back_when_the_worker_is_fatal(tiny_ckpt):
    """A worker that leaves broken answers what waited for a group `retryable`: another worker runs it."""
    from compute_driver import Driven, queued

    from laya_pool.protocol import wire

    rt = Runtime(load_checkpoint(tiny_ckpt))
    d = Driven(rt, max_group=8)
    d.compute.waiting.extend(queued(i, Batch.from_rows(make_rows(20 + i, 2))) for i in range(3))
    d.compute.fatal = "planted"
    d.compute.inbox.put(None)
    d.compute.loop()
    replies = [wire.parse_any_reply(wire.decode(f)) for f in d.frames]
    assert sorted(r.rid for r in replies) == [0, 1, 2] and {r.status for r in replies} == {"retryable"}
    assert not d.compute.waiting
