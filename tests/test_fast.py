"""The fast path (kernels/fast.py) on the CPU, through Triton's interpreter.

The interpreter runs the real kernels (their indexing, masks, fused epilogues, the attention band) with
numpy arithmetic; it cannot run bf16 dots, so these tests run the fast path in fp16 against the reference
forward. Speed, bf16 numbers and bit-level batch invariance are the gpu tests' and the benchmarks' job.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from laya_pool.kernels.arch import parse_arch
from laya_pool.kernels.gemm import Epi, Tiles, early_epilogue, fill_tiles, geglu_pairs, pick_tiles
from laya_pool.kernels.reference import ReferenceModel
from laya_pool.worker.checkpoint import load_checkpoint


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# conftest.py turns the interpreter on before anything imports Triton, on machines without CUDA.
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not _has_triton(),
                                 reason="needs Triton's CPU interpreter (machines without CUDA)")

# The interpreter runs a whole forward in minutes; the first test to use a `models` fixture also builds it.
pytestmark = pytest.mark.timeout(900)

PRESET_SHAPES = {"tiny": (128, 192), "large": (1024, 2624), "multilingual": (768, 1152)}


def _gemms(d: int, ff: int) -> list[tuple[int, int, Epi]]:
    return [(3 * d, d, Epi.ROPE), (d, d, Epi.RESIDUAL), (ff, d, Epi.GEGLU), (ff, d, Epi.GEGLU_PAIRS),
            (d, ff, Epi.RESIDUAL), (4 * d, d, Epi.PLAIN), (d, 4 * d, Epi.RESIDUAL), (1, d, Epi.PLAIN),
            (256, d + 4, Epi.PLAIN)]


@pytest.mark.parametrize("preset", sorted(PRESET_SHAPES))
def test_every_tile_choice_keeps_the_invariance_preconditions(preset):
    """What kernels/gemm.py's invariance rests on: for every M a worker can run, every GEMM issues the
    warpgroup MMA (M tile >= 64, 4 or 8 warps), and K tiles are whole 16-steps."""
    d, ff = PRESET_SHAPES[preset]
    for n, k, epi in _gemms(d, ff):
        for m in list(range(1, 130)) + [192, 256, 512, 513, 1024, 1536, 2048, 4096, 8192, 16384]:
            for t in (pick_tiles(m, n, k, epi), fill_tiles(pick_tiles(m, n, k, epi), m, n, 132)):
                assert t.bm >= 64 and t.warps in (4, 8) and t.bk % 16 == 0 and t.bn >= 16, (preset, n, k, epi, m, t)


def test_epilogue_operands_come_early_only_at_small_m():
    """Read before the K loop at M <= 64 (1x48 3% faster on the H200); at large M a 128x128 tile holding its residual
    spills (16x512 13% slower)."""
    assert early_epilogue(48) and early_epilogue(64)
    assert not early_epilogue(65) and not early_epilogue(8192)


def test_geglu_pairs_interleave_input_and_gate_rows():
    """Output column f's input row and gate row side by side (rows 2f and 2f + 1), each row whole: the GEGLU_PAIRS
    epilogue reads a pair from one thread's neighbouring accumulator columns, and no dot product changes."""
    ff, k = 6, 4
    w = torch.arange(2 * ff * k, dtype=torch.float32).view(2 * ff, k)
    p = geglu_pairs(w)
    assert p.is_contiguous() and p.shape == w.shape
    for f in range(ff):
        assert torch.equal(p[2 * f], w[f]) and torch.equal(p[2 * f + 1], w[ff + f])


def test_pairs_tiles_hold_whole_pairs():
    """A GEGLU_PAIRS tile's columns are (input, gate) pairs: an even BN, so no pair straddles two programs."""
    for m in list(range(1, 130)) + [512, 513, 1536, 8192]:
        t = pick_tiles(m, 2624, 1024, Epi.GEGLU_PAIRS)
        assert t.bn % 2 == 0 and t.bn >= 2, (m, t)


def test_small_m_gets_enough_programs_to_stream_weights():
    # A 1x48 request is weight-bandwidth bound: a 1024-wide projection must not run on a handful of SMs.
    t = pick_tiles(48, 1024, 1024, Epi.RESIDUAL)
    assert 1024 // t.bn >= 32, t


@pytest.mark.parametrize("m", [48, 256, 1024, 1536, 2048, 8192])
def test_residual_tiles_fill_the_sms_in_one_chain(m):
    """One K chain (the default) gives a residual GEMM no chunk programs: its tiles shrink until the programs cover
    the SMs, as far as 16-wide tiles allow, and never shrink past that."""
    sms, n = 132, 1024
    t = fill_tiles(pick_tiles(m, n, 1024, Epi.RESIDUAL), m, n, sms)
    programs = -(-m // t.bm) * -(-n // t.bn)
    assert programs >= sms or (t.bm, t.bn) == (64, 16), (m, t, programs)
    wider = Tiles(t.bm, 2 * t.bn, t.bk, t.warps, t.stages)
    assert t == pick_tiles(m, n, 1024, Epi.RESIDUAL) or -(-m // wider.bm) * -(-n // wider.bn) < sms, (m, t)


@pytest.mark.parametrize("preset", sorted(PRESET_SHAPES))
def test_k_chunks_are_whole_tiles_and_a_function_of_k_alone(preset, monkeypatch):
    """What the split residual GEMM's invariance rests on (chunks are opt-in: LAYA_K_CHUNKS=1): two chunks whose edge
    is a whole K tile at every tiling the GEMM may pick, the same for every M (k_chunk takes no M), and split tiles
    that only narrow N."""
    from laya_pool.kernels.gemm import k_chunk, split_tiles
    monkeypatch.setenv("LAYA_K_CHUNKS", "1")
    d, ff = PRESET_SHAPES[preset]
    for k in (d, ff, 4 * d):
        c = k_chunk(k)
        if c:
            assert c % 128 == 0 and c < k <= 2 * c, (k, c)
        for m in (1, 48, 64, 65, 512, 2048, 8192):
            t = pick_tiles(m, d, k, Epi.RESIDUAL)
            assert not c or c % t.bk == 0, (k, c, m, t)
            s = split_tiles(t, m, d, 2, 132)
            assert (s.bm, s.bk, s.warps) == (t.bm, t.bk, t.warps) and 16 <= s.bn <= t.bn, (t, s)


@pytest.fixture(scope="module", params=["triton", "sdpa"])
def models(tiny_ckpt, request):
    """The fast path with each attention (kernels/fast.py's ATTENTION): ours, packed and banded, and torch's
    SDPA on the SDK's padded layout."""
    from laya_pool.kernels.fast import FastModel
    ck = load_checkpoint(tiny_ckpt)
    return (ck, FastModel(ck.arch, ck.tensors, device="cpu", dtype=torch.float16, attention=request.param),
            ReferenceModel(ck.arch, ck.tensors, dtype=torch.float16, gemm="vendor"),
            ReferenceModel(ck.arch, ck.tensors, dtype=torch.float32))


def _inputs(lens, k=4, extra_rows=0, seed=0, types=None):
    rng = np.random.default_rng(seed)
    ids = np.concatenate([rng.integers(5, 1000, n) for n in lens]).astype(np.int32)
    rows = len(lens) + extra_rows
    starts = np.zeros(rows, np.int32)
    starts[: len(lens)] = np.concatenate([[0], np.cumsum(lens)[:-1]])
    length = np.zeros(rows, np.int32)
    length[: len(lens)] = lens
    mk = np.full((rows, k), -1, np.int32)
    for r, n in enumerate(lens):
        mk[r, :3] = [1, n // 2, n - 1]
    qt = np.array(types if types is not None else [r % 3 for r in range(rows)], np.int32)
    t = torch.from_numpy
    return dict(ids=t(np.concatenate([ids, np.full(64, 3, np.int32)])), row_start=t(starts), row_len=t(length),
                qtype=t(qt), markers=t(mk), max_row_len=max(lens))


@interpreted
def test_fast_forward_matches_the_reference(models):
    """Rows longer than the tiny model's 16-token window, a padding row, an absent marker column."""
    ck, fast, ref16, ref32 = models
    inp = _inputs([48, 20, 33], extra_rows=1)
    lf, af = fast(**inp)
    l16, a16 = ref16(**inp)
    l32, a32 = ref32(**inp)
    real = inp["markers"][:3] >= 0
    assert torch.all(lf[:3][~real] == -1e4) and torch.isfinite(af).all()
    pf, p16, p32 = (torch.softmax(x[:3].float(), -1) for x in (lf, l16, l32))
    noise = float((p16 - p32).abs().max())            # the reference's own fp16-vs-fp32 distance
    assert float((pf - p32).abs().max()) <= max(2 * noise, 5e-3), (pf, p32)
    assert float((af[:3] - a32[:3]).abs().max()) <= max(2 * float((a16[:3] - a32[:3]).abs().max()), 5e-3)


@interpreted
def test_a_row_never_sees_its_neighbours(models):
    """Same shapes, other rows' tokens and types changed: row 0 answers the same bits (no leak across rows
    through attention, the packed GEMMs or the gathers)."""
    _, fast, _, _ = models
    a = _inputs([40, 30, 25], seed=1, types=[0, 1, 2])
    b = _inputs([40, 30, 25], seed=1, types=[0, 2, 1])
    b["ids"][40:95] = torch.from_numpy(np.random.default_rng(9).integers(5, 1000, 55).astype(np.int32))
    la, aa = fast(**a)
    lb, ab = fast(**b)
    assert torch.equal(la[0], lb[0]) and torch.equal(aa[0], ab[0])
    assert not torch.equal(la[1], lb[1])


@interpreted
def test_taps_follow_the_reference(models):
    ck, fast, ref16, _ = models
    inp = _inputs([30, 18])
    got, want = {}, {}
    fast(**inp, taps=got)
    ref16(**inp, taps=want)
    assert set(want) <= set(got)
    for name in ("embeddings", "encoder.0", "final_norm", f"head.{ck.arch.head_layers - 1}"):
        g, w = got[name][0, :30].float(), want[name][0, :30].float()
        assert float((g - w).norm() / w.norm()) < 5e-3, name


@interpreted
def test_split_residual_gemm_equals_the_unsplit_one_bit_for_bit():
    """A residual GEMM with K in chunks gives the same bits whether its chunks run in their own programs and the
    next LayerNorm adds them up (small M), or one program adds them in turn (large M); with biases as the
    decision head rounds them too."""
    from laya_pool.kernels import rows as rk
    from laya_pool.kernels.gemm import Tiles, residual
    g = torch.Generator().manual_seed(3)
    m, k, n = 48, 320, 64              # chunks of 192 and 128: the second one's last K tile is half past K
    a = torch.randn(m, k, generator=g).half()
    w = (torch.randn(n, k, generator=g) / 8).half()
    bias = torch.randn(n, generator=g).half()
    h0 = torch.randn(m, n, generator=g)
    norm_w = torch.ones(n)
    # One tiling for all three: the interpreter's dots are numpy matmuls, whose sums may follow the tile shape
    # (the hardware's MMA chain does not: the GPU probe checks every tiling).
    tiles = Tiles(64, 32, 64, 4, 2)
    for b, apart in ((None, False), (bias, False), (bias, True)):
        whole, alone, split = h0.clone(), h0.clone(), h0.clone()
        assert residual(a, w, whole, None, bias=b, bias_apart=apart, chunk=0, tiles=tiles) is None
        assert residual(a, w, alone, None, bias=b, bias_apart=apart, chunk=192, tiles=tiles) is None
        parts = torch.empty(2, m, n)
        pending = residual(a, w, split, parts, bias=b, bias_apart=apart, chunk=192, split=True, tiles=tiles)
        assert pending is not None and pending.chunks == 2 and torch.equal(split, h0), "nothing added yet"
        x = torch.empty(m, n, dtype=torch.float16)
        rk.layer_norm(split, norm_w, None, x, 1e-5, pending)
        assert torch.equal(split, alone), (b is not None, apart)
        assert torch.allclose(alone, whole, atol=1e-2)


@interpreted
def test_a_forward_with_split_gemms_answers_the_bits_of_one_without(models, monkeypatch):
    """The whole fast forward, residual GEMMs in K chunks: split into programs (and finished by the row kernels)
    or not split at all, the same logits and act probabilities."""
    import laya_pool.kernels.fast as fast_mod
    import laya_pool.kernels.gemm as gemm_mod
    from laya_pool.kernels.fast import FastModel
    ck = models[0]
    monkeypatch.setattr(gemm_mod, "k_chunk", lambda k: -(-k // 256) * 128 if k > 128 else 0)   # tiny K: 192, 512
    monkeypatch.setattr(fast_mod, "k_chunk", gemm_mod.k_chunk)
    monkeypatch.setattr(gemm_mod, "split_tiles", lambda t, *_: t)    # one tiling: see the test above
    monkeypatch.setattr(gemm_mod, "fill_tiles", lambda t, *_: t)     # (numpy's sums change with the tile shape)
    model = FastModel(ck.arch, ck.tensors, device="cpu", dtype=torch.float16, attention=models[1].attention)
    assert model.max_chunks > 1
    inp = _inputs([40, 25, 9], extra_rows=1)
    split = model(**inp)
    monkeypatch.setattr(fast_mod, "SPLIT_MAX_M", 0)        # no chunk-sum workspace: every GEMM finishes itself
    whole = model(**inp)
    assert torch.equal(split[0], whole[0]) and torch.equal(split[1], whole[1])


def test_unsupported_configurations_say_why():
    from laya_pool.kernels.fast import supports
    arch = load_checkpoint_arch()
    why = supports(arch, torch.device("cpu"), torch.float32)
    assert why is not None and ("bf16" in why or "Triton" in why), why


def load_checkpoint_arch():
    agent = {"encoder": "x", "head_layers": 2, "max_len": 64}
    enc = {"model_type": "modernbert", "hidden_size": 128, "num_attention_heads": 2, "num_hidden_layers": 3,
           "vocab_size": 100, "intermediate_size": 64}
    return parse_arch(agent, enc)


@interpreted
@pytest.mark.parametrize("bn", [16, 32, 64, 128])
def test_rope_epilogue_tiles_within_and_across_heads(bn):
    """The QKV GEMM's RoPE epilogue on `rope_pairs` weights, its N tile inside one head (bn <= D) or spanning
    several heads: every query and key column rotated by its token's position, written to its own place; value
    columns untouched."""
    from laya_pool.kernels.gemm import Tiles, gemm, rope_pairs
    from laya_pool.kernels.reference import _rope_tables, _rotate_half
    g = torch.Generator().manual_seed(5)
    heads, d, m, k = 3, 32, 40, 64
    a = torch.randn(m, k, generator=g).half()
    w = (torch.randn(3 * heads * d, k, generator=g) / 8).half()
    pos = torch.randint(0, 100, (m,), generator=g, dtype=torch.int32)
    cos, sin = _rope_tables(128, d, 10000.0, "cpu")
    out = torch.empty(m, 3 * heads * d, dtype=torch.float16)
    gemm(a, rope_pairs(w, d), out, epi=Epi.ROPE, rope=(pos, cos[:, : d // 2].contiguous(),
                                                       sin[:, : d // 2].contiguous(), d, 2 * heads),
         tiles=Tiles(64, bn, 64, 4, 2))
    y = (a.float() @ w.float().T).half().float().view(m, 3 * heads, d)
    c, s = cos[pos.long()][:, None, :], sin[pos.long()][:, None, :]
    want = y.clone()
    want[:, : 2 * heads] = y[:, : 2 * heads] * c + _rotate_half(y[:, : 2 * heads]) * s
    assert torch.allclose(out.float().view(m, 3 * heads, d), want, atol=2e-3, rtol=2e-3)
    # Value columns: the GEMM alone (numpy's sums may round an ulp apart from torch's, so not bit for bit here).
    assert torch.allclose(out.float().view(m, 3 * heads, d)[:, 2 * heads:], y[:, 2 * heads:], atol=1e-3, rtol=1e-3)


@interpreted
@pytest.mark.parametrize("bn", [16, 32, 64])
def test_geglu_pairs_epilogue_writes_each_column_once(bn):
    """The GeGLU GEMM on `geglu_pairs` weights with F = 37 (no tile divides 2F, so the last program's tile runs past
    the last weight row) into a slice of a wider output: column f is gelu(input f) * gate f, as the two-accumulator
    form and torch compute it; the columns past F stay untouched."""
    from laya_pool.kernels.gemm import Tiles, geglu_pairs, gemm
    g = torch.Generator().manual_seed(6)
    ff, m, k = 37, 70, 64
    a = torch.randn(m, k, generator=g).half()
    w = (torch.randn(2 * ff, k, generator=g) / 8).half()
    wide = torch.full((m, ff + 5), 7.0).half()
    gemm(a, geglu_pairs(w), wide[:, :ff], epi=Epi.GEGLU_PAIRS, tiles=Tiles(64, bn, 64, 4, 2))
    two = torch.empty(m, ff).half()
    gemm(a, w, two, epi=Epi.GEGLU, tiles=Tiles(64, bn, 64, 4, 2))
    y = (a.float() @ w.float().T).half().float()
    want = torch.nn.functional.gelu(y[:, :ff]).half().float() * y[:, ff:]
    assert torch.allclose(wide[:, :ff].float(), want, atol=2e-3, rtol=2e-3)
    assert torch.allclose(wide[:, :ff].float(), two.float(), atol=2e-3, rtol=2e-3)
    assert bool((wide[:, ff:] == 7.0).all())


@interpreted
@pytest.mark.parametrize("window", [8, None])
def test_packed_attention_is_softmax_attention_row_by_row(window):
    """kernels/attention.py over three packed rows (one longer than a key block, so the online softmax rescales and
    the per-thread sums carry), banded and global: each row's output is SDPA's on that row alone in fp32, within
    fp16's rounding; tokens past the rows stay untouched. (cuDNN's bits need the device: the gpu parity test.)"""
    from laya_pool.kernels.attention import attention
    g = torch.Generator().manual_seed(3)
    heads, dim, lens = 2, 32, [150, 9, 40]
    starts = [0, 150, 159]
    total = sum(lens)
    qkv = torch.randn(total + 4, 3 * heads * dim, generator=g).half()
    out = torch.full((total + 4, heads * dim), 7.0).half()
    attention(qkv, out, torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), heads, dim,
              max(lens), window, dim ** -0.5)
    for s0, n in zip(starts, lens):
        x = qkv[s0:s0 + n].float().view(n, 3, heads, dim)
        q, k, v = (x[:, j].transpose(0, 1) for j in range(3))
        pos = torch.arange(n)
        band = (pos[:, None] - pos[None, :]).abs() <= (n if window is None else window)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=dim ** -0.5)
        got = out[s0:s0 + n].float()
        assert float((got - want.transpose(0, 1).reshape(n, -1)).abs().max()) < 2e-3, (s0, n)
    assert torch.all(out[total:] == 7.0)
