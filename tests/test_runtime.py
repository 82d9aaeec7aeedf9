"""Worker runtime on the CPU: whole-group validation, workspace reuse, and the graph-cache policy."""
import numpy as np
import pytest
import torch
from conftest import make_rows

from laya_pool.worker.batch import Batch, Limits, RequestError, validate
from laya_pool.worker.checkpoint import load_checkpoint
from laya_pool.worker.graphs import CachePolicy, GraphCache, GraphEntry
from laya_pool.worker.runtime import ROW_STEP, Runtime, bucket_of, bucket_rows
from laya_pool.worker.workspace import FIELDS, Capacity, Shape, Workspace, act_at, readbacks

LIMITS = Limits(vocab_size=100, max_len=32, max_tokens=64, max_rows=4, max_markers=16)


def good() -> Batch:
    return Batch.from_rows([(np.arange(10) + 5, [3, 6], 0), (np.arange(7) + 5, [1, 2, 4], 2)])


def test_good_batch_passes():
    validate(good(), LIMITS)


def _mutate(**fields) -> Batch:
    b = good()
    for k, v in fields.items():
        setattr(b, k, v)
    return b


BAD = [
    ("ids", dict(ids=np.arange(17, dtype=np.int64)), "1-D int32", None),
    ("ids", dict(lengths=np.array([10, 8], np.int32)), "add up to 18", None),
    ("lengths", dict(lengths=np.array([0, 17], np.int32)), "outside 1..32", 0),
    ("lengths", dict(lengths=np.array([], np.int32)), "at least one row", None),
    ("types", dict(types=np.array([0, 3], np.int32)), "not 0, 1 or 2", 1),
    ("types", dict(types=np.array([0], np.int32)), "1 entries for 2 rows", None),
    ("ids", dict(ids=np.r_[np.arange(10) + 5, [5, 6, 100, 7, 8, 9, 10]].astype(np.int32)), "outside the vocab", 1),
    ("ids", dict(ids=np.r_[[-1], np.arange(16)].astype(np.int32)), "outside the vocab", 0),
    ("marker_counts", dict(marker_counts=np.array([0, 5], np.int32)), "at least one marker", 0),
    ("markers", dict(markers=np.array([3, 6, 1, 2, 7], np.int32)), "outside its row of length 7", 1),
    ("markers", dict(markers=np.array([3, 3, 1, 2, 4], np.int32)), "strictly ascending", 0),
    ("markers", dict(markers=np.array([3, 6, 2, 1, 4], np.int32)), "strictly ascending", 1),
    ("markers", dict(markers=np.array([3, 6, 1, 2], np.int32)), "add up to 5", None),
]


@pytest.mark.parametrize("field,change,message,row", BAD)
def test_every_field_is_checked_and_named(field, change, message, row):
    with pytest.raises(RequestError) as e:
        validate(_mutate(**change), LIMITS)
    assert e.value.field == field and e.value.row == row
    assert message in str(e.value) and field in str(e.value)
    if row is not None:
        assert f"row {row}" in str(e.value)


def test_capacity_limits():
    rows = [(np.arange(20) + 5, [1], 1)] * 4
    with pytest.raises(RequestError, match="80 tokens exceed"):
        validate(Batch.from_rows(rows), LIMITS)
    with pytest.raises(RequestError, match="5 rows exceed"):
        validate(Batch.from_rows([(np.arange(3) + 5, [1], 1)] * 5), LIMITS)
    with pytest.raises(RequestError, match="17 markers exceed"):
        validate(Batch.from_rows([(np.arange(16) + 5, np.arange(9), 1), (np.arange(16) + 5, np.arange(8), 1)]),
                 LIMITS)


@pytest.fixture(scope="module")
def runtime(tiny_ckpt):
    return Runtime(load_checkpoint(tiny_ckpt), device="cpu", capacity=Capacity(1024, 8, 256, 32))


def _rows(seed: int, n: int, vocab: int):
    return make_rows(seed, n, length=(12, 60), markers=(1, 5), vocab=vocab)


def test_the_runtime_says_which_forward_it_runs_and_why(runtime):
    """On the CPU the reference forward, and the reason (the fast path needs CUDA and bf16); the status carries it."""
    assert runtime.forward_name == "reference" and runtime.why_reference
    assert runtime.forward_detail == f"reference ({runtime.why_reference})"
    assert runtime.stats()["forward_detail"] == runtime.forward_detail


def test_workspace_is_reused_by_address(runtime):
    ws = runtime.workspace
    addrs = (ws.host_address, ws.device_address, ws.out.ctypes.data)
    vocab = runtime.checkpoint.arch.vocab_size
    for seed in range(3):
        runtime.run(Batch.from_rows(_rows(seed, 3, vocab)))
        assert (ws.host_address, ws.device_address, ws.out.ctypes.data) == addrs


def test_bad_request_leaves_runtime_serving(runtime):
    vocab = runtime.checkpoint.arch.vocab_size
    rows = _rows(7, 2, vocab)
    want = runtime.run(Batch.from_rows(rows))
    bad = Batch.from_rows(rows)
    bad.ids[3] = vocab + 5
    with pytest.raises(RequestError, match="outside the vocabulary"):
        runtime.run(bad)
    again = runtime.run(Batch.from_rows(rows))
    assert np.array_equal(want.logits, again.logits) and np.array_equal(want.act, again.act)


def test_runtime_matches_direct_reference_and_shapes(runtime):
    """The staging path (pack, views, readback) returns exactly what the forward computes on the rows."""
    from laya_pool.kernels.reference import ReferenceModel
    vocab = runtime.checkpoint.arch.vocab_size
    rows = _rows(3, 4, vocab)
    got = runtime.run(Batch.from_rows(rows))
    assert got.logits.shape == (sum(len(r[1]) for r in rows),) and got.act.shape == (4, runtime.checkpoint.arch.n_act)
    model = ReferenceModel(runtime.checkpoint.arch, runtime.checkpoint.tensors)
    for i, (ids, markers, qt) in enumerate(rows):
        logits, act = model.forward(torch.tensor(ids), torch.tensor([0]), torch.tensor([len(ids)]),
                                    torch.tensor([qt]), torch.tensor(markers)[None], len(ids))
        lo = sum(len(r[1]) for r in rows[:i])
        np.testing.assert_allclose(got.logits[lo: lo + len(markers)], logits[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(got.act[i], act[0].numpy(), atol=1e-6)


def test_graph_modes_refused_on_cpu(tiny_ckpt, runtime):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Runtime(load_checkpoint(tiny_ckpt), device="cpu", mode="graph-cached")
    with pytest.raises(RequestError, match="needs a CUDA worker"):
        runtime.run(good_tiny(runtime), mode="graph-fixed")


def good_tiny(runtime):
    return Batch.from_rows(_rows(1, 1, runtime.checkpoint.arch.vocab_size))


def test_bucket_rounding(runtime):
    b = Batch.from_rows([(np.arange(65) + 5, [1, 2, 3], 0)] * 3)
    assert runtime.bucket(b) == Shape(4, 80, 4)         # rows to a power of two, length to a multiple of 16
    b = Batch.from_rows([(np.arange(64) + 5, [1, 2], 0)])
    assert runtime.bucket(b) == Shape(1, 64, 2)
    # past 8 rows, steps of 8: 20 rows (five merged 4x256 requests) pad to 24, not 32
    assert bucket_of(20, 250, 3, Capacity(), 8192) == Shape(24, 256, 4)


def test_bucket_rows_pad_at_most_a_step_past_it():
    got = [bucket_rows(n) for n in range(1, 65)]
    assert got[:8] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert all(n <= b <= max(8, n + ROW_STEP - 1) and (b <= 8 or b % ROW_STEP == 0) for n, b in zip(range(1, 65), got))
    assert sorted(set(got[8:])) == list(range(16, 65, ROW_STEP))


class RealBytes:
    """Capture/release that hold real buffers: the cache sees the bytes those buffers really take."""

    def __init__(self, sizes: dict):
        self.sizes, self.live = sizes, {}

    def capture(self, key) -> GraphEntry:
        if self.sizes[key] is None:
            raise RuntimeError("capture failed")
        buf = torch.empty(self.sizes[key], dtype=torch.uint8)
        self.live[key] = buf
        return GraphEntry(graph=None, outputs=(), pool=key, nbytes=buf.untyped_storage().nbytes())

    def release(self, entry: GraphEntry) -> int:
        return self.live.pop(entry.pool).untyped_storage().nbytes()


def _simulate(policy: CachePolicy, sizes: dict, stream: list):
    """An independent model of the policy: a list in recency order, evict from the front."""
    held, hits, fallbacks, uncacheable = [], 0, 0, set()
    for key in stream:
        if key in held:
            hits += 1
            held.remove(key)
            held.append(key)
            continue
        if policy.max_entries <= 0 or policy.max_bytes <= 0 or key in uncacheable or sizes[key] is None \
                or sizes[key] > policy.max_bytes:
            fallbacks += 1
            uncacheable.add(key)
            continue
        while held and (sum(sizes[k] for k in held) + sizes[key] > policy.max_bytes
                        or len(held) + 1 > policy.max_entries):
            held.pop(0)
        held.append(key)
    return held, hits, fallbacks


SIZES = {"a": 1000, "b": 3000, "c": 5000, "d": 6000, "e": 10001, "f": None}
STREAM = list("abcabdabcdeefaabbccdd") * 2


@pytest.mark.parametrize("policy", [CachePolicy(2, 1 << 20), CachePolicy(10, 9000), CachePolicy(10, 10000),
                                    CachePolicy(3, 6000), CachePolicy(0, 1 << 20), CachePolicy(8, 0)])
def test_cache_policy_matches_independent_model(policy):
    real = RealBytes(SIZES)
    cache = GraphCache(policy, real.capture, real.release)
    for key in STREAM:
        cache.lookup(key)
        assert cache.counters.bytes_held <= policy.max_bytes
        assert len(cache.keys()) <= max(policy.max_entries, 0)
        assert set(real.live) == set(cache.keys()), "evicted entries must be released"
    held, hits, fallbacks = _simulate(policy, SIZES, STREAM)
    assert cache.keys() == held
    assert (cache.counters.hits, cache.counters.fallbacks) == (hits, fallbacks)
    assert cache.counters.bytes_held == sum(SIZES[k] for k in held)


def test_entry_exactly_at_budget_fits_and_larger_runs_eager():
    real = RealBytes({"x": 4096, "y": 4097})
    cache = GraphCache(CachePolicy(4, 4096), real.capture, real.release)
    assert cache.lookup("x") is not None and cache.keys() == ["x"]
    assert cache.lookup("y") is None and cache.counters.oversized == 1 and "y" not in real.live
    assert cache.lookup("y") is None and cache.counters.oversized == 1, "oversized is never re-captured"
    assert cache.counters.fallbacks == 2 and cache.keys() == ["x"]


def test_eviction_reports_returned_bytes():
    real = RealBytes({"x": 3000, "y": 2500})
    cache = GraphCache(CachePolicy(1, 1 << 20), real.capture, real.release)
    cache.lookup("x")
    cache.lookup("y")
    assert cache.counters.evictions == 1 and cache.counters.bytes_returned == 3000 and cache.keys() == ["y"]


def test_warmup_shapes_parse_and_refuse_garbage():
    from laya_pool.worker.runtime import DEFAULT_WARMUP, parse_shapes
    shapes = parse_shapes(DEFAULT_WARMUP)
    assert Shape(16, 512, 16) in shapes and all(s.row_len % 64 == 0 for s in shapes)
    assert parse_shapes(" 2x128x4 ,") == (Shape(2, 128, 4),)
    with pytest.raises(ValueError, match="bad shape '4x2'"):
        parse_shapes("1x64x2,4x2")


def test_sticky_cuda_errors_are_told_from_a_failed_copy():
    """A copy that fails because an earlier kernel poisoned the context (a sticky error) makes the worker leave; a
    copy that fails on its own (a bad pointer: the injected upload fault) does not. The codes are the runtime's own."""
    rt = pytest.importorskip("cuda.bindings.runtime")
    from laya_pool.worker.cudart import is_sticky
    for name in ("cudaErrorInvalidAddressSpace", "cudaErrorIllegalAddress", "cudaErrorLaunchFailure"):
        assert is_sticky(int(getattr(rt.cudaError_t, name))), name
    for name in ("cudaErrorInvalidValue", "cudaErrorMemoryAllocation", "cudaErrorNotReady"):
        assert not is_sticky(int(getattr(rt.cudaError_t, name))), name


def _forward_may_read(views, shape: Shape) -> bool:
    """The fast forward's input contract for `shape` (kernels/fast.py): every row inside the shape's tokens,
    no row longer than the shape's row length, every marker inside its row."""
    _, start, length, _, markers = (v.numpy() for v in views)
    inside = (length <= shape.row_len).all() and (start + length <= shape.rows * shape.row_len).all()
    return bool(inside and (markers < np.maximum(length, 1)[:, None]).all())


def test_a_capture_warms_up_on_a_mirror_with_no_request():
    """The warm-up forward before a capture reads blank views: the live mirror holds the last group laid out
    for its own shape, whose rows reach past a smaller shape's tokens (attention then reads and writes past its
    buffers: a fault from a cold Triton cache, where the allocator's layout differs)."""
    from laya_pool.worker.workspace import Workspace
    ws = Workspace(Capacity(max_tokens=256, max_rows=8, max_markers=64, row_markers=8), 4, torch.device("cpu"))
    long = Batch.from_rows(make_rows(3, n=4, length=60, markers=(2, 6)))
    ws.pack(long, Shape(4, 64, 8))
    small = Shape(2, 16, 2)
    assert not _forward_may_read(ws.views(small), small)       # what the warm-up used to read
    blank, live = ws.blank_views(small), ws.views(small)
    assert _forward_may_read(blank, small)
    base_blank, base_live = blank[0].data_ptr(), live[0].data_ptr()
    for b, v in zip(blank, live):
        # the same layout, so the same kernel specializations as a capture over the live mirror
        assert b.shape == v.shape and b.stride() == v.stride() and b.dtype == v.dtype
        assert b.data_ptr() - base_blank == v.data_ptr() - base_live
    assert ws.blank_views(small)[1].data_ptr() == blank[1].data_ptr()      # allocated once


@pytest.mark.parametrize("seed", range(4))
def test_the_one_row_fast_check_never_passes_what_the_full_check_refuses(seed):
    """worker/batch.py `plainly_valid` may say "look closer" wrongly, never "valid" wrongly: on one-row batches
    with each field pushed in and out of its range, it passes only batches `check_values` passes, and it passes
    most valid ones (else it would save nothing)."""
    from laya_pool.worker.batch import check_values, plainly_valid
    rng = np.random.default_rng(seed)
    passed = valid = 0
    for _ in range(3000):
        n = int(rng.integers(-1, LIMITS.max_len + 3))
        size = max(0, max(n, 0) + int(rng.integers(-1, 2)) * int(rng.random() < 0.1))    # sometimes one off
        ids = rng.integers(-2, LIMITS.vocab_size + 2, size) if rng.random() < 0.5 else rng.integers(5, 90, size)
        k = int(rng.integers(0, 5))
        mk = np.sort(rng.integers(-1, max(n, 1) + 1, k)) if rng.random() < 0.5 else rng.integers(-1, n + 2, k)
        b = Batch(ids=ids.astype(np.int32), lengths=np.array([n], np.int32),
                  types=np.array([rng.integers(-1, 5)], np.int32),
                  marker_counts=np.array([k + int(rng.integers(-1, 2)) * (rng.random() < 0.1)], np.int32),
                  markers=mk.astype(np.int32))
        try:
            check_values(b, LIMITS)
            ok = True
        except RequestError:
            ok = False
        except (IndexError, ValueError):
            continue            # sizes the structural checks in `validate` refuse before either runs
        fast = plainly_valid(b, LIMITS)
        assert not fast or ok, b
        passed += fast
        valid += ok
    assert valid > 150 and passed == valid, (passed, valid)


def test_one_copy_up_and_one_back():
    """A slot's fields lie 64-byte aligned with the ids last, so one span from its start to the last token uploads a
    group; the forward lays act out after the logits as the slot does, so one copy reads both back (else two)."""
    ws = Workspace(Capacity(max_tokens=100, max_rows=5, max_markers=20, row_markers=3), n_act=3,
                   device=torch.device("cpu"))
    assert list(ws.offsets) == list(FIELDS) and FIELDS[-1] == "ids"
    assert all(at % 16 == 0 for at in ws.offsets.values()), ws.offsets
    b = Batch.from_rows([(np.arange(10, 17, dtype=np.int32), np.array([1, 3], np.int32), 2),
                         (np.arange(20, 25, dtype=np.int32), np.array([2], np.int32), 1)])
    shape = Shape(4, 8, 3)
    (start, count), = ws.pack(b, shape)
    up = ws.host_in[start: start + count]          # what the one copy carries
    o = ws.offsets
    assert up[o["ids"]: o["ids"] + b.tokens].tolist() == b.ids.tolist() and start + count == o["ids"] + b.tokens
    assert up[o["row_start"]: o["row_start"] + 4].tolist() == [0, 7, 0, 0]
    assert up[o["row_len"]: o["row_len"] + 4].tolist() == [7, 5, 0, 0]
    assert up[o["qtype"]: o["qtype"] + 2].tolist() == [2, 1]
    assert up[o["markers"]: o["markers"] + 6].tolist() == [1, 3, -1, 2, -1, -1]

    at = act_at(shape.rows, shape.row_markers)
    assert at == 16 and act_at(4, 4) == 16 and act_at(3, 6) == 32
    logits, act = ws.outputs(0, shape)
    assert logits.size == 12 and act.size == 12 and act.ctypes.data == ws.out.ctypes.data + 4 * at
    answers = torch.zeros(at + 12)
    one = readbacks(answers[:12].view(4, 3), answers[at:].view(4, 3), shape)
    assert one == ((0, answers.data_ptr(), 4 * (at + 12)),)
    apart = torch.zeros(12), torch.zeros(12)
    assert readbacks(apart[0].view(4, 3), apart[1].view(4, 3), shape) == (
        (0, apart[0].data_ptr(), 48), (4 * at, apart[1].data_ptr(), 48))
