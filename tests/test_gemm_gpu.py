"""The GeGLU GEMM's two forms on a real GPU (kernels/gemm.py): one accumulator over Wi's interleaved (input, gate) rows
(GEGLU_PAIRS, the default) gives the bits of two accumulators over Wi as the checkpoint holds it (GEGLU), at every M
a worker runs and at other tilings, alone and in a whole forward.

Run on the device: `python -m pytest -q -m gpu tests/test_gemm_gpu.py -s`.
"""
from __future__ import annotations

import pytest
import torch
from laya_pool.kernels.gemm import Epi, Tiles, geglu_pairs, gemm
from laya_pool.worker.checkpoint import load_checkpoint

pytestmark = pytest.mark.gpu

D, FF = 1024, 2624          # the large preset's Wi: (2 x 2,624, 1,024)


@pytest.fixture(scope="module")
def operands():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    a = torch.randn(8192, D, device="cuda").bfloat16()
    w = (torch.randn(2 * FF, D, device="cuda") / D ** 0.5).bfloat16()
    return a, w


def _geglu(a, w, m, epi, tiles=None):
    out = torch.empty(m, FF, device="cuda", dtype=torch.bfloat16)
    gemm(a[:m], w, out, epi=epi, tiles=tiles)
    return out


@pytest.mark.parametrize("m", [1, 48, 64, 65, 128, 512, 1024, 1536, 4096, 8192])
def test_pairs_give_the_two_accumulators_bits(operands, m):
    a, w = operands
    assert torch.equal(_geglu(a, geglu_pairs(w), m, Epi.GEGLU_PAIRS), _geglu(a, w, m, Epi.GEGLU))


@pytest.mark.parametrize("tiles", [Tiles(64, 32, 128, 4, 3), Tiles(64, 128, 64, 4, 4), Tiles(128, 256, 64, 8, 3)])
def test_pairs_bits_do_not_depend_on_the_tiling(operands, tiles):
    a, w = operands
    assert torch.equal(_geglu(a, geglu_pairs(w), 1536, Epi.GEGLU_PAIRS, tiles), _geglu(a, w, 1536, Epi.GEGLU))


def test_a_planted_row_swap_is_seen(operands):
    """The comparison can fail: input and gate swapped in one pair changes that output column and no other."""
    a, w = operands
    planted = geglu_pairs(w).clone()
    planted[[10, 11]] = planted[[11, 10]]
    got, want = _geglu(a, planted, 48, Epi.GEGLU_PAIRS), _geglu(a, w, 48, Epi.GEGLU)
    differs = (got != want).any(0).nonzero().flatten().tolist()
    assert differs == [5]


def test_a_forward_is_the_same_in_either_form(tiny_ckpt, monkeypatch):
    from laya_pool.kernels.fast import FastModel
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ck = load_checkpoint(tiny_ckpt)
    monkeypatch.setenv("LAYA_GEGLU", "two")
    two = FastModel(ck.arch, ck.tensors, device="cuda")
    monkeypatch.delenv("LAYA_GEGLU")
    pairs = FastModel(ck.arch, ck.tensors, device="cuda")
    assert (two.geglu, pairs.geglu) == (Epi.GEGLU, Epi.GEGLU_PAIRS)
    g = torch.Generator().manual_seed(1)
    rows, length = 3, 40
    inp = dict(ids=torch.randint(10, 1000, (rows * length,), generator=g, dtype=torch.int32).cuda(),
               row_start=(torch.arange(rows, dtype=torch.int32) * length).cuda(),
               row_len=torch.tensor([40, 17, 33], dtype=torch.int32).cuda(),
               qtype=torch.tensor([0, 1, 2], dtype=torch.int32).cuda(),
               markers=torch.stack([torch.arange(5, 17, 3, dtype=torch.int32)] * rows).cuda(), max_row_len=length)
    for x, y in zip(two(**inp), pairs(**inp)):
        assert torch.equal(x, y)
