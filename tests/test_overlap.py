"""The worker's device path on the CPU: the staging-slot ledger, the warm-up plan from the merge policy, missed
buckets served by a larger captured one and captured when idle, and the compute thread's two-group loop.

The two-group loop runs for real here: a CPU runtime built with `overlap=True` has two slots, and the compute
thread launches group N+1 before it answers group N exactly as on CUDA (the CPU forward just finishes inside
launch). The device half (events, one device mirror, graphs) is tests/test_serving_gpu.py.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
from compute_driver import Driven, queued, rows

from laya_pool.worker.batch import Batch
from laya_pool.worker.checkpoint import load_checkpoint
from laya_pool.worker.compute import FaultHooks
from laya_pool.worker.graphs import CachePolicy, GraphCache, GraphEntry, smallest_cover
from laya_pool.worker.merge import Group
from laya_pool.worker.runtime import (
    DEFAULT_MERGED,
    Runtime,
    RuntimeConfig,
    bucket_of,
    merged_buckets,
    parse_shapes,
    settles,
    warmup_plan,
)
from laya_pool.worker.slots import SlotError, SlotLedger, SlotState
from laya_pool.worker.workspace import Capacity, Shape

CAP = Capacity(max_tokens=4096, max_rows=64, max_markers=1024, row_markers=32)


# -- the slot ledger ----------------------------------------------------------------------------------------

def test_slot_ledger_walks_free_packing_queued_free():
    ledger = SlotLedger(2)
    a = ledger.acquire()
    assert (a, ledger.writable(a)) == (0, True)
    ledger.submitted(a)
    assert not ledger.writable(a), "a slot whose copies are queued must not be written"
    b = ledger.acquire()
    assert b == 1 and ledger.in_flight == 2 and ledger.free() is None
    with pytest.raises(SlotError, match="finish the oldest"):
        ledger.acquire()
    ledger.release(a)
    assert ledger.states == [SlotState.FREE, SlotState.PACKING] and ledger.acquire() == 0
    ledger.submitted(0)
    with pytest.raises(SlotError, match="not packing"):
        ledger.submitted(0)
    ledger.release(0)
    with pytest.raises(SlotError, match="released twice"):
        ledger.release(0)
    ledger.release(1)                         # a launch that failed while packing frees its slot
    assert ledger.in_flight == 0 and ledger.launched == 2
    with pytest.raises(ValueError):
        SlotLedger(0)


def test_runtime_refuses_a_third_launch_and_frees_a_failed_ones_slot(tiny_ckpt):
    rt = Runtime(load_checkpoint(tiny_ckpt), config=RuntimeConfig(capacity=CAP, overlap=True))
    rng = np.random.default_rng(0)
    a, b, c = (rows(rng, 2, 30, 3) for _ in range(3))
    ja, jb = rt.launch(a), rt.launch(b)
    assert (rt.depth, rt.slots.in_flight, {ja.slot, jb.slot}) == (2, 2, {0, 1})
    with pytest.raises(SlotError):
        rt.launch(c)
    assert rt.slots.in_flight == 2, "the refused launch took no slot"
    want_a = Runtime(load_checkpoint(tiny_ckpt), config=RuntimeConfig(capacity=CAP)).run(a)
    got_a = rt.finish(ja)
    assert np.array_equal(got_a.logits, want_a.logits) and np.array_equal(got_a.act, want_a.act)
    rt.finish(jb)
    bad = Batch(**{**{k: getattr(c, k) for k in ("ids", "lengths", "types", "marker_counts", "markers")},
                   "ids": np.full_like(c.ids, 10**6)})
    with pytest.raises(Exception, match="vocabulary"):
        rt.launch(bad)
    assert rt.slots.in_flight == 0


# -- smallest cover, deferred captures ----------------------------------------------------------------------

def test_a_close_cover_settles_a_bucket_and_a_far_one_does_not():
    """Buckets step by 16 tokens; a held bucket no longer than the 64-token step would have made serves a miss for
    good (no more captures than steps of 64 made), anything larger is captured when idle."""
    from laya_pool.worker.runtime import settles
    assert settles(Shape(1, 32, 4), Shape(1, 48, 4)) and settles(Shape(8, 112, 4), Shape(8, 128, 4))
    assert settles(Shape(4, 64, 2), Shape(4, 64, 4))                        # more marker slots: the same work
    assert not settles(Shape(1, 48, 4), Shape(1, 128, 4))                  # 128 > 64: worth its own graph
    assert not settles(Shape(2, 48, 4), Shape(4, 48, 4))                   # more rows
    assert not settles(Shape(1, 80, 4), Shape(1, 256, 4)) and settles(Shape(1, 80, 4), Shape(1, 128, 4))


def test_smallest_cover_picks_the_least_padded_holder():
    held = [Shape(32, 64, 4), Shape(4, 64, 4), Shape(8, 128, 4), Shape(16, 512, 16)]
    assert smallest_cover(Shape(3, 64, 4), held) == Shape(4, 64, 4)
    assert smallest_cover(Shape(5, 64, 2), held) == Shape(8, 128, 4)      # 1,024 padded tokens, not 2,048
    assert smallest_cover(Shape(2, 256, 8), held) == Shape(16, 512, 16)
    assert smallest_cover(Shape(1, 64, 32), held) is None                 # nothing has 32 markers a row
    assert smallest_cover(Shape(64, 64, 2), held) is None


def _fake_cache(policy=CachePolicy()):
    captured = []

    def capture(key):
        captured.append(key)
        if key == Shape(2, 64, 2):
            raise RuntimeError("capture failed")
        return GraphEntry(graph=None, outputs=(), pool=None, nbytes=1 << 20)
    return GraphCache(policy, capture, lambda e: e.nbytes), captured


def test_a_miss_is_deferred_once_and_captured_when_idle():
    cache, captured = _fake_cache()
    a, b, broken = Shape(4, 64, 4), Shape(8, 64, 4), Shape(2, 64, 2)
    for key in (a, a, b, broken):
        assert cache.get(key) is None and cache.defer(key)
    c = cache.counters
    assert (c.misses, c.deferred, captured) == (4, 3, []), "deferring captures nothing"
    assert cache.capture_pending() == a and cache.capture_pending() == b
    assert cache.capture_pending() == broken and cache.capture_pending() is None
    assert captured == [a, b, broken] and c.idle_captures == 2 and c.capture_failures == 1
    assert c.request_path_captures == 0 and c.captures == 2
    assert cache.get(a) is not None and not cache.defer(broken), "a failed bucket is never deferred again"
    cache.lookup(Shape(16, 64, 4))            # the inline path: a request waits for this one
    assert c.request_path_captures == 1
    off, _ = _fake_cache(CachePolicy(max_entries=0))
    assert not off.defer(a) and off.capture_pending() is None
    # what traffic missed stays counted after the capture (status lists it for the operator's warm-up)
    assert cache.missed == {a: 2, b: 1, broken: 2, Shape(16, 64, 4): 1}


# -- the warm-up plan ---------------------------------------------------------------------------------------

def _class_batch(rng, c: Shape) -> Batch:
    return rows(rng, c.rows, c.row_len, c.row_markers)


@pytest.mark.parametrize("max_group", [1, 8, 32])
def test_warmup_plan_is_what_merged_groups_produce(tiny_ckpt, max_group):
    """Independent check: build the groups the compute thread would (Group.admits, up to max_group), merge them,
    and bucket them with the runtime's own rule; the plan must be exactly those buckets."""
    rt = Runtime(load_checkpoint(tiny_ckpt), config=RuntimeConfig(capacity=CAP))
    max_len = rt.checkpoint.arch.max_len
    classes = parse_shapes(DEFAULT_MERGED) + (Shape(4, 200, 3),)
    rng = np.random.default_rng(1)
    produced = set()
    for c in classes:
        if c.row_len > max_len:
            continue
        g = Group()
        for _ in range(max_group):
            b = _class_batch(rng, c)
            if g.batches and not g.admits(b, CAP):
                break
            g.add(b)
            produced.add(rt.bucket(g.merged()))
    planned = merged_buckets(classes, max_group, CAP, max_len)
    assert set(planned) == produced, (sorted(produced), planned)
    if max_group == 32:
        assert Shape(32, 48, 4) in planned and Shape(64, 208, 4) not in planned   # 64x200 > 4,096 tokens
    assert bucket_of(3, 65, 5, CAP, max_len) == Shape(4, 80, 8)


def test_default_warmup_covers_merged_small_requests(tiny_ckpt):
    """A worker at its defaults (max_batch 32) has every bucket a group of 1-32 one-question requests of 48 or
    128 tokens (or a little less) lands in, so those groups never miss; one of 100 tokens (bucket 112) runs in a
    held bucket that covers it until its own is captured while idle."""
    cap = Capacity()
    rt = Runtime(load_checkpoint(tiny_ckpt), config=RuntimeConfig(
        capacity=cap, warmup_shapes=(Shape(16, 512, 16),), warmup_merged=parse_shapes(DEFAULT_MERGED),
        warmup_group=32))
    plan = set(rt.warmup_plan())
    rng = np.random.default_rng(2)
    for length in (40, 48, 100, 120, 128):
        for n in (1, 2, 3, 5, 9, 17, 32):
            merged = Group([rows(rng, 1, length, 4) for _ in range(n)]).merged()
            if length == 100:
                assert rt.bucket(merged) not in plan and smallest_cover(rt.bucket(merged), plan), (length, n)
            else:
                assert rt.bucket(merged) in plan, (length, n)
    assert rt.warmup_plan() == sorted(plan, reverse=True), "largest first"


def test_settled_plan_leaves_out_what_a_planned_bucket_does_with_more_marker_slots():
    """A bucket whose rows and length a planned bucket has (more marker slots: the same work) is not captured for an
    idle-capture runtime, which serves it from that cover; one the cover would pad longer stays; an inline runtime,
    which captures a miss instead of taking a cover, keeps them all."""
    cap = Capacity()
    shapes = (Shape(8, 256, 8), Shape(8, 256, 4), Shape(1, 64, 4), Shape(1, 64, 2))
    classes = (Shape(1, 48, 4),)
    full = warmup_plan(shapes, classes, 4, cap, 512)
    settled = warmup_plan(shapes, classes, 4, cap, 512, settled=True)
    assert set(full) - set(settled) == {Shape(8, 256, 4), Shape(1, 64, 2)}
    assert Shape(1, 48, 4) in settled and Shape(4, 48, 4) in settled     # 1x64 would pad them: kept
    # each one left out is served for good by the cover a miss finds (`Runtime._plan`: no deferral, no eager run)
    assert all(settles(sh, smallest_cover(sh, settled)) for sh in full)
    assert settled == sorted(settled, reverse=True)


def test_runtime_plans_settled_only_when_it_takes_covers(tiny_ckpt):
    def plan(capture: str) -> list[Shape]:
        return Runtime(load_checkpoint(tiny_ckpt), config=RuntimeConfig(
            capacity=CAP, capture=capture, warmup_shapes=(Shape(4, 64, 8), Shape(4, 64, 4)))).warmup_plan()

    assert plan("idle") == [Shape(4, 64, 8)] and plan("inline") == [Shape(4, 64, 8), Shape(4, 64, 4)]


# -- the two-group compute loop ------------------------------------------------------------------------------

def _mixed_requests(seed: int, n: int) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [rows(rng, int(rng.integers(1, 4)), int(rng.integers(8, 90)), int(rng.integers(1, 5))) for _ in range(n)]


def _record_depth(rt: Runtime) -> list[int]:
    """Wrap rt.launch to record how many groups were launched and unanswered right after each launch."""
    seen: list[int] = []
    launch = rt.launch

    def recording(*a, **kw):
        job = launch(*a, **kw)
        seen.append(rt.slots.in_flight)
        return job
    rt.launch = recording
    return seen


@pytest.mark.parametrize("sockets", [False, True], ids=["queue", "data-socket"])
@pytest.mark.parametrize("gap_s", [0.0, 0.002])
def test_two_group_loop_answers_exactly_as_one_at_a_time(tiny_ckpt, gap_s, sockets):
    """overlap on (two slots, N+1 launched before N is answered) against off, same requests, one reply each; CPU
    groups of one request (CPU GEMMs are not batch-invariant, so merged bits would differ either way). Requests come
    through a queue, or through the worker's data socket (the data thread's own inbox)."""
    ck = load_checkpoint(tiny_ckpt)
    batches = _mixed_requests(3, 40)
    bad = 11
    batches[bad] = Batch(**{**{k: getattr(batches[bad], k) for k in ("ids", "lengths", "types", "marker_counts",
                                                                     "markers")},
                            "ids": np.full_like(batches[bad].ids, 5000)})
    answers = {}
    for overlap in (False, True):
        rt = Runtime(ck, config=RuntimeConfig(capacity=CAP, overlap=overlap))
        deepest = _record_depth(rt)
        d = Driven(rt, max_group=1, sockets=sockets)
        answers[overlap] = d.run([queued(i, b) for i, b in enumerate(batches)], gap_s=gap_s)
        if gap_s == 0:
            assert max(deepest) == (2 if overlap else 1), "with requests waiting, overlap keeps two groups launched"
        assert d.counts["ok"] == len(batches) - 1 and d.counts["request_errors"] == 1
        assert rt.slots.in_flight == 0 and rt.slots.launched == len(batches) - 1
        assert d.compute.busy_since is None and not d.compute.flights
    for rid in range(len(batches)):
        a, b = answers[False][rid], answers[True][rid]
        assert a.status == b.status, rid
        if rid == bad:
            assert a.status == "final" and a.error["field"] == "ids"
            continue
        assert np.array_equal(a.logits, b.logits) and np.array_equal(a.act, b.act), rid


def test_planted_slot_reuse_is_caught(tiny_ckpt):
    """The harness can fail: a runtime that packs every group into slot 0 while the previous group's answers
    still sit there (what a missing ledger would allow) gives wrong answers, and the comparison sees it."""
    ck = load_checkpoint(tiny_ckpt)
    batches = _mixed_requests(4, 12)
    want = Driven(Runtime(ck, config=RuntimeConfig(capacity=CAP)), 1).run([queued(i, b) for i, b in enumerate(batches)])
    rt = Runtime(ck, config=RuntimeConfig(capacity=CAP, overlap=True))
    pack = rt.workspace.pack
    rt.workspace.pack = lambda batch, shape, slot=0: pack(batch, shape, 0)
    real_answers = rt._answers
    rt._answers = lambda job, t4: real_answers(type(job)(**{**job.__dict__, "slot": 0}), t4)
    got = Driven(rt, 1).run([queued(i, b) for i, b in enumerate(batches)])
    differ = [i for i in range(len(batches)) if not np.array_equal(got[i].logits, want[i].logits)]
    assert differ, "sharing one slot between two groups in flight must show"


@pytest.mark.parametrize("sockets", [False, True], ids=["queue", "data-socket"])
def test_a_failed_launch_with_a_group_in_flight_is_answered_alone(tiny_ckpt, sockets):
    """LAYA_WORKER_FAULT_ROWS raises inside the launch of any group holding a 3-row request: with a group in
    flight, that group is still answered right, and the faulty request alone fails (internal, on the CPU)."""
    ck = load_checkpoint(tiny_ckpt)
    rng = np.random.default_rng(5)
    batches = [rows(rng, 3 if i in (4, 9) else 1 + i % 2, 40, 2) for i in range(16)]
    want = Driven(Runtime(ck, config=RuntimeConfig(capacity=CAP)), 1).run([queued(i, b) for i, b in enumerate(batches)])
    rt = Runtime(ck, config=RuntimeConfig(capacity=CAP, overlap=True))
    d = Driven(rt, max_group=4, faults=FaultHooks(fault_rows=3), sockets=sockets)
    got = d.run([queued(i, b) for i, b in enumerate(batches)])
    for i in range(len(batches)):
        if i in (4, 9):
            assert got[i].status == "final" and "injected fault" in got[i].message
        else:
            assert got[i].status == "ok", got[i].message
            np.testing.assert_allclose(got[i].logits, want[i].logits, atol=1e-4)
    assert d.counts["internal_errors"] == 2 and rt.slots.in_flight == 0


# -- the landing watch ---------------------------------------------------------------------------------------

class _DeviceEvent:
    """Stands in for a CUDA done event (no device here): `wait` blocks until the test lets the group land."""

    def __init__(self, fail: bool = False):
        self.go, self.fail = threading.Event(), fail

    def wait(self) -> None:
        assert self.go.wait(5), "never released"
        if self.fail:
            raise RuntimeError("device fault")


def test_landing_watch_reports_in_launch_order_and_hands_errors_over():
    import queue as stdqueue

    from laya_pool.worker.landing import Landed, LandingWatch
    posted: stdqueue.Queue = stdqueue.Queue()
    watch = LandingWatch(posted.put)
    jobs = [SimpleNamespace(event=_DeviceEvent(fail=i == 1), landed=None, error=None) for i in range(3)]
    flights = [SimpleNamespace(job=j) for j in jobs]
    for f in flights:
        watch.watch(f)
    assert posted.empty() and not any(j.landed.is_set() for j in jobs), "nothing lands before its event"
    quiet = threading.Thread(target=watch.quiesce)
    quiet.start()
    quiet.join(0.1)
    assert quiet.is_alive(), "quiesce must wait while the watch waits on an event (a capture would break)"
    jobs[0].event.go.set()
    first = posted.get(timeout=5)
    assert isinstance(first, Landed) and first.flight is flights[0] and jobs[0].error is None
    jobs[2].event.go.set()                     # lands on the device first, but is reported after the one before it
    with pytest.raises(stdqueue.Empty):
        posted.get(timeout=0.1)
    jobs[1].event.go.set()
    assert [posted.get(timeout=5).flight for _ in range(2)] == flights[1:]
    assert isinstance(jobs[1].error, RuntimeError) and all(j.landed.is_set() for j in jobs)
    quiet.join(5)
    assert not quiet.is_alive() and watch.waiting == 0
    cpu = SimpleNamespace(job=SimpleNamespace(event=None, landed=None, error=None))
    watch.watch(cpu)                           # the CPU computed inside launch: reported at once
    assert posted.get_nowait().flight is cpu
    watch.close()
