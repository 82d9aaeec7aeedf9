"""The worker's serving path on a real GPU (tiny preset, ~30 s): overlap on == off, merged == alone, no captures on the
request path after READY, a failed upload with a group in flight.

Run on the device: `python -m pytest -q -m gpu tests/test_serving_gpu.py -s`. Requests go through the worker's real
compute thread (tests/compute_driver.py: the wire codec both ways; through a queue, or the worker's data socket).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from compute_driver import Driven, queued, rows
from conftest import wait_until

from laya_pool.worker.batch import Batch
from laya_pool.worker.checkpoint import load_checkpoint
from laya_pool.worker.runtime import DEFAULT_MERGED, DEFAULT_WARMUP, Runtime, RuntimeConfig, parse_shapes
from laya_pool.worker.workspace import Capacity, Shape

pytestmark = pytest.mark.gpu
CAP = Capacity(max_tokens=4096, max_rows=32, max_markers=1024, row_markers=16)
FIXED = Shape(32, 128, 8)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return load_checkpoint(tiny_ckpt)


def worker_runtime(ckpt, mode: str = "graph-cached", overlap: bool = True, capture: str = "idle",
                   warm: bool = True) -> Runtime:
    """A runtime set up as `worker.server` sets one up (default warm-up: named shapes + merged classes, group 32)."""
    cfg = RuntimeConfig(mode=mode, capacity=CAP, fixed_shape=FIXED, overlap=overlap, capture=capture,
                        warmup_shapes=parse_shapes(DEFAULT_WARMUP) if warm else (),
                        warmup_merged=parse_shapes(DEFAULT_MERGED) if warm else (), warmup_group=32)
    rt = Runtime(ckpt, device="cuda", config=cfg)
    rt.warmup()
    return rt


def small_requests(seed: int, n: int) -> list[Batch]:
    """What a decision loop sends most: one question (2-4 options) over 20-128 tokens, some with two questions."""
    rng = np.random.default_rng(seed)
    return [rows(rng, 1 + int(rng.random() < 0.2), int(rng.choice([20, 48, 48, 64, 100, 128])), int(rng.integers(2, 5)))
            for _ in range(n)]


def record_depth(rt: Runtime) -> list[int]:
    seen: list[int] = []
    launch = rt.launch

    def recording(*a, **kw):
        job = launch(*a, **kw)
        seen.append(rt.slots.in_flight)
        return job
    rt.launch = recording
    return seen


def same(a, b) -> bool:
    return a.status == b.status == "ok" and np.array_equal(a.logits, b.logits) and np.array_equal(a.act, b.act)


@pytest.mark.parametrize("mode", ["eager", "graph-fixed", "graph-cached"])
def test_overlap_on_equals_off_and_merged_equals_alone(ckpt, mode):
    """Each request alone, one group at a time (overlap off, groups of one) is the reference; then merged groups of
    up to 32 with overlap on and off, all requests queued at once (two groups in flight) and as a stream."""
    batches = small_requests(1, 96)
    items = lambda: [queued(i, b) for i, b in enumerate(batches)]    # noqa: E731
    alone = Driven(worker_runtime(ckpt, mode, overlap=False, warm=mode == "graph-cached"), 1).run(items())
    for overlap in (False, True):
        rt = worker_runtime(ckpt, mode, overlap=overlap, warm=mode == "graph-cached")
        depth = record_depth(rt)
        # through a queue (and the landing-watch thread), then the worker's data socket (the data thread polling the
        # socket and the launched group's CUDA event)
        for gap_s, sockets in ((0.0, False), (0.0003, False), (0.0, True), (0.0003, True)):
            d = Driven(rt, max_group=32, sockets=sockets)
            got = d.run(items(), gap_s=gap_s)
            bad = [i for i in range(len(batches)) if not same(got[i], alone[i])]
            assert not bad, (mode, overlap, gap_s, sockets, bad[:5])
            # All queued at once must merge; a stream may find the device done before the next request arrives (a
            # fast forward on an H200 does), and then the feed shows overlap == alone only.
            assert gap_s or d.counts["merged_runs"] > 0, "nothing merged: the test would not show merged == alone"
        assert max(depth) == (2 if overlap else 1), (mode, overlap, max(depth))
        print(f"\n{mode}, overlap {'on' if overlap else 'off'}: {len(batches)} requests x 2 feeds byte-identical to "
              f"alone; {rt.slots.launched} groups launched, deepest {max(depth)}; cache {rt.cache.counters}")


def test_no_captures_on_the_request_path_after_ready(ckpt):
    """After READY a stream of merged small requests captures nothing: each runs in a bucket the warm-up held (its
    own, or one that serves it for good: lengths of 20 or 100 tokens make buckets of 32 and 112, which the held 48
    and 128 serve, `runtime.settles`). A request outside the plan runs in a larger captured bucket (or eager), its own
    bucket is captured once the worker is idle, and it hits from then on; inline capture (the old way) shows up in
    the same counter."""
    rt = worker_runtime(ckpt)
    eager = worker_runtime(ckpt, "eager", warm=False)
    c = rt.cache.counters
    captures_at_ready = c.captures
    batches = small_requests(2, 160)
    d = Driven(rt, max_group=32)
    want = Driven(eager, 1).run([queued(i, b) for i, b in enumerate(batches)])
    for gap_s in (0.0, 0.0002, 0.001):
        got = d.run([queued(i, b) for i, b in enumerate(batches)], gap_s=gap_s)
        assert all(same(got[i], want[i]) for i in range(len(batches)))
        # "covered": a bucket with more marker slots and the same rows x length: the same work, nothing to capture
        states = {r.metrics["graph"] for r in got.values()}
        assert states <= {"hit", "covered"}, states
    sizes = sorted({r.metrics["batched"] for r in got.values()})
    assert (c.request_path_captures, c.captures, c.fallbacks) == (0, captures_at_ready, 0), c
    print(f"\n{len(batches)} x 3 streams of small requests: group sizes {sizes}; cache {c}")

    while rt.has_idle_work:          # anything the stream left for an idle moment, so `odd` is the next in line
        rt.idle_work()
    idle = c.idle_captures
    odd = Batch.from_rows([(np.arange(5, 305, dtype=np.int32), np.array([3, 9, 40, 77, 100], np.int32), 1)] * 3)
    bucket = rt.bucket(odd)
    assert bucket not in rt.cache.keys()
    first = Driven(rt, 1).run([queued(0, odd)])[0]
    assert first.metrics["graph"] in ("covered", "deferred") and c.request_path_captures == 0
    assert same(first, Driven(eager, 1).run([queued(0, odd)])[0])
    assert rt.has_idle_work and rt.idle_work() == bucket and c.idle_captures == idle + 1
    again = Driven(rt, 1).run([queued(0, odd)])[0]
    assert again.metrics["graph"] == "hit" and same(again, first)

    inline = worker_runtime(ckpt, capture="inline", warm=False)
    Driven(inline, 32).run([queued(i, b) for i, b in enumerate(batches[:40])])
    assert inline.cache.counters.request_path_captures > 0, "the counter must see captures a request waited for"


def test_failed_upload_with_a_group_in_flight(ckpt):
    """The second group's upload fails (its one copy aimed at an invalid device pointer, inside the real
    cudaMemcpyAsync) while the first group computes: the first is answered right, the failed one's requests
    are retryable, nothing was queued to drain, and the worker serves the rest."""
    batches = small_requests(3, 12)
    want = Driven(worker_runtime(ckpt, overlap=False), 1).run([queued(i, b) for i, b in enumerate(batches)])
    rt = worker_runtime(ckpt)
    groups = []

    def fault(i: int) -> bool:
        if i == 0:
            groups.append(1)
        return len(groups) == 2                  # the second group's copy
    rt.upload.fault = fault
    d = Driven(rt, max_group=1)
    got = d.run([queued(i, b) for i, b in enumerate(batches)])
    assert got[1].status == "retryable" and got[1].error.get("reason") == "upload-failed", got[1]
    assert rt.upload.drains == 0 and rt.upload.last_drained_after == 0
    assert all(same(got[i], want[i]) for i in range(len(batches)) if i != 1)
    assert d.counts["upload_errors"] == 1 and rt.slots.in_flight == 0


def thread_cpus(pid: int) -> dict[str, str]:
    """Each named thread of process `pid` and the CPUs it may run on (/proc)."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/comm") as f:
            name = f.read().strip()
        with open(f"/proc/{pid}/task/{task}/status") as f:
            out[name] = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("Cpus_allowed_list"))
    return out


def test_a_cuda_pool_takes_requests_on_the_data_socket(tiny_ckpt, ckpt):
    """A real pool on the device (`laya-pool up`: broker + one CUDA worker, real sockets): requests reach the worker's
    data thread directly (its I/O thread hands over none), from the clients themselves (a CUDA worker's default:
    client/direct.py) or through the broker, answers equal an in-process eager runtime's bit for bit, and a burst
    from several threads merges there. The data thread runs on the CPU `--data-cpu` names (LAYA_DATA_CPU), the rest
    of the worker where it was."""
    import concurrent.futures as cf

    from laya_pool.client.local import local_pool

    eager = worker_runtime(ckpt, "eager", warm=False)
    batches = small_requests(4, 48)
    want = Driven(eager, 1).run([queued(i, b) for i, b in enumerate(batches)])
    as_rows = [[(b.ids[s:s + n], b.markers[m:m + c], int(t)) for s, n, m, c, t in
                zip(np.cumsum([0, *b.lengths[:-1]]), b.lengths, np.cumsum([0, *b.marker_counts[:-1]]),
                    b.marker_counts, b.types)] for b in batches]
    data_cpu = max(os.sched_getaffinity(0))
    with local_pool(tiny_ckpt, "cuda:0", startup_timeout=240, env={"LAYA_DATA_CPU": str(data_cpu)}) as pool:
        pinned = thread_cpus(pool.status()["workers"][0]["pid"])
        assert pinned["compute"] == str(data_cpu) and pinned["io"] != str(data_cpu), pinned
        with pool.client() as c, pool.client(direct=False) as via_broker:
            for i in range(4):        # one at a time first, both ways
                np.testing.assert_array_equal(c.forward(as_rows[i]).flat, want[i].logits)
                np.testing.assert_array_equal(via_broker.forward(as_rows[i]).flat, want[i].logits)
            direct = c._routes.sent

            def one(i):
                with pool.client() as ci:
                    return i, ci.forward(as_rows[i])
            with cf.ThreadPoolExecutor(8) as ex:
                for i, got in ex.map(one, range(len(batches))):
                    np.testing.assert_array_equal(got.flat, want[i].logits)
            # the worker's counts reach the status with its next heartbeat (one a second)
            st = wait_until(lambda: (s := pool.status())["workers"][0]["stats"].get("received", 0) >= 56 and s, 5,
                            lambda: f"the worker never counted 56 requests: {pool.status()['workers']}")
    stats = st["workers"][0]["stats"]
    assert stats["via_control"] == 0, stats
    assert st["broker"]["counters"].get("routed_to_control", 0) == 0, st["broker"]["counters"]
    # All but a first, before its connection; on the direct socket or, once the worker took the client's lane (a CUDA
    # worker's default on x86-64 Linux: protocol/lane.py), through shared memory.
    assert direct >= 3 and stats["direct"] + stats["lanes"] >= direct, (direct, stats)
    print(f"\nCUDA pool: {stats['received']} requests on the data thread ({stats['direct']} sent to it directly, "
          f"{stats['lanes']} on lanes), merged runs {stats['merged_runs']}")
