"""kernels/cublas.py on the CPU: the proof ledger, when a proof may run, layouts for proofs, and the RoPE that
follows cuBLAS's QKV product (through Triton's interpreter) against the fused ROPE epilogue, bit for bit. Whether
cuBLAS gives our bits on a device is tests/test_cublas_gpu.py's question."""
from __future__ import annotations

import os

import pytest
import torch

from laya_pool.kernels import cublas


def test_the_ledger_remembers_both_answers_and_is_bounded():
    proofs = cublas.Proofs(limit=3)
    assert proofs.get("a") is None
    proofs.put("a", True)
    proofs.put("b", False)
    assert proofs.get("a") is True and proofs.get("b") is False
    assert proofs.summary() == {"proven": 1, "refused": 1}
    proofs.put("c", True)
    proofs.put("d", True)          # at the limit: everything is proven again from here
    assert proofs.get("a") is None and proofs.get("d") is True


def test_a_shape_is_proven_once_and_its_answer_kept():
    products = cublas.Products(torch.device("cpu"))
    calls = []

    def prove(answer):
        def run():
            calls.append(answer)
            return answer
        return run
    assert products.use("k1", prove(True)) is True
    assert products.use("k1", prove(False)) is True      # kept: not proven again
    assert products.use("k2", prove(False)) is False
    assert products.use("k2", prove(True)) is False
    assert calls == [True, False]


def test_no_answer_kept_while_recording():
    """A compile-ahead recording launches nothing (kernels/compile.py), so a proof there compares garbage: it runs for
    the launches it records, its answer is dropped, the shape runs our kernel and is proven later."""
    compile_ = pytest.importorskip("laya_pool.kernels.compile")
    if compile_.triton_knobs() is None:
        pytest.skip("needs Triton")
    products = cublas.Products(torch.device("cpu"))
    calls = []
    with compile_.recorded():
        assert compile_.recording()
        assert products.use("k", lambda: calls.append(1) or True) is False
    assert not compile_.recording()
    assert calls == [1] and products.proofs.get("k") is None
    assert products.use("k", lambda: calls.append(2) or True) is True and calls == [1, 2]
    assert products.use("k", lambda: calls.append(3) or False) is True and calls == [1, 2]


def test_only_large_m_asks_and_the_switch_turns_it_off(monkeypatch):
    monkeypatch.delenv("LAYA_CUBLAS", raising=False)
    assert not cublas.wanted(cublas.LOW - 1) and cublas.wanted(cublas.LOW) and cublas.wanted(8192)   # on by default
    monkeypatch.setenv("LAYA_CUBLAS", "1")
    assert cublas.wanted(8192)
    monkeypatch.setenv("LAYA_CUBLAS", "0")
    assert not cublas.wanted(8192)


@pytest.mark.parametrize("offset", [0, 3, 40])
def test_a_proof_tensor_is_laid_out_as_the_real_one(offset):
    base = torch.empty(4096, dtype=torch.bfloat16)
    real = base[offset:offset + 30 * 64].view(30, 64)[:, :48]     # strided rows, as `mid[:, :intermediate]`
    copy = cublas.like(real, random=True)
    assert copy.shape == real.shape and copy.stride() == real.stride()
    assert copy.data_ptr() % 256 == real.data_ptr() % 256
    assert copy.float().std() > 0.5                                # standard normal values
    assert torch.equal(copy, cublas.like(real, random=True))       # a fixed seed: nothing drawn from torch's own
    assert cublas.key("k", real, base.view(64, 64), base.view(64, 64)) != cublas.key("k", copy.contiguous(),
                                                                                      base.view(64, 64),
                                                                                      base.view(64, 64))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and cublas.triton is not None


@pytest.mark.skipif(not _interpreted(), reason="needs Triton's CPU interpreter (machines without CUDA)")
@pytest.mark.parametrize("heads", [2, 3])      # 3: six rotated heads, not a power of two (masked blocks)
def test_rope_after_the_product_rotates_as_torch_does(heads):
    """`rotate` (what follows cuBLAS's QKV product) against torch's x * cos + rotate_half(x) * sin with each product
    rounded alone, every bit; value heads untouched. (The fused ROPE epilogue's bits are the device proof's
    question: each shape compares the two before cuBLAS runs it.)"""
    from laya_pool.kernels.reference import _rope_tables, _rotate_half
    g = torch.Generator().manual_seed(3)
    d, m = 32, 24
    y = torch.randn(m, 3 * heads * d, generator=g).half()
    pos = torch.randint(0, 100, (m,), generator=g, dtype=torch.int32)
    cos, sin = _rope_tables(128, d, 10000.0, "cpu")
    out = y.clone()
    cublas.rotate(out, pos, cos[:, : d // 2].contiguous(), sin[:, : d // 2].contiguous(), d, 2 * heads)
    x = y.float().view(m, 3 * heads, d)[:, : 2 * heads]
    c, s = cos[pos.long()][:, None, :], sin[pos.long()][:, None, :]
    want = y.clone().view(m, 3 * heads, d)
    want[:, : 2 * heads] = (x * c + _rotate_half(x) * s).half()
    assert torch.equal(out, want.view(m, -1))
    assert not torch.equal(out, y)
