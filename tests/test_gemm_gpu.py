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


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("m", [1, 48, 200, 1536])
def test_pairs_past_the_last_row_and_into_a_strided_output(m, tma):
    """F = 100 (no tiling divides 2F): the last program's weight tile runs past the last row, loaded by pointers or by
    the copy engine; the output is a slice of a wider buffer, whose columns past F stay untouched."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(1)
    ff, k = 100, 128
    a = torch.randn(m, k, device="cuda").bfloat16()
    w = (torch.randn(2 * ff, k, device="cuda") / k ** 0.5).bfloat16()
    want = torch.empty(m, ff, device="cuda", dtype=torch.bfloat16)
    gemm(a, w, want, epi=Epi.GEGLU)
    wide = torch.full((m, ff + 28), 7.0, device="cuda", dtype=torch.bfloat16)
    gemm(a, geglu_pairs(w), wide[:, :ff], epi=Epi.GEGLU_PAIRS, tma=tma)
    assert torch.equal(wide[:, :ff], want)
    assert bool((wide[:, ff:] == 7.0).all())


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
    monkeypatch.setenv("LAYA_GEGLU", "tow")
    with pytest.raises(ValueError, match="LAYA_GEGLU"):
        FastModel(ck.arch, ck.tensors, device="cuda")
    monkeypatch.delenv("LAYA_GEGLU")
    g = torch.Generator().manual_seed(1)
    rows, length = 3, 40
    inp = dict(ids=torch.randint(10, 1000, (rows * length,), generator=g, dtype=torch.int32).cuda(),
               row_start=(torch.arange(rows, dtype=torch.int32) * length).cuda(),
               row_len=torch.tensor([40, 17, 33], dtype=torch.int32).cuda(),
               qtype=torch.tensor([0, 1, 2], dtype=torch.int32).cuda(),
               markers=torch.stack([torch.arange(5, 17, 3, dtype=torch.int32)] * rows).cuda(), max_row_len=length)
    for x, y in zip(two(**inp), pairs(**inp)):
        assert torch.equal(x, y)


_FIRST_GEMM = """
import torch
from laya_pool.kernels.exact import bf16_values
from laya_pool.kernels.gemm import Epi, gemm
v = bf16_values("cuda")
a = torch.zeros(v.numel(), 64, device="cuda", dtype=torch.bfloat16)
a[:, 0], a[:, 1] = v, 1.0
w = torch.zeros(32, 64, device="cuda", dtype=torch.bfloat16)    # geglu_pairs order: input rows e0, gate rows e1
w[0::2, 0], w[1::2, 1] = 1.0, 1.0
out = torch.empty(v.numel(), 16, device="cuda", dtype=torch.bfloat16)
gemm(a, w, out, epi=Epi.GEGLU_PAIRS)
print(int((out[:, 0] != torch.nn.functional.gelu(v)).sum()))
"""


def _first_gemm_differs(env: dict | None = None) -> int:
    import os
    import subprocess
    import sys
    base = {k: v for k, v in os.environ.items() if k != "TRITON_LIBDEVICE_PATH"}
    done = subprocess.run([sys.executable, "-c", _FIRST_GEMM], capture_output=True, text=True, timeout=300,
                          env={**base, **(env or {})})
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_a_gemm_compiled_before_any_model_gives_torchs_gelu():
    """A process whose first GEMM runs before any model is loaded (a probe, a test) compiles its GELU against the
    toolkit's libdevice too: Triton's in-memory kernel cache ignores the libdevice knob, so a kernel compiled before
    the knob was set stayed (kernels/launch.py `link_libdevice`). A fresh process: each GeGLU output's GELU of every
    finite bf16 value (input v, gate 1) must be torch's; planted, Triton's own libdevice must show a difference."""
    from pathlib import Path

    import triton

    from laya_pool.kernels.launch import toolkit_libdevice
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if toolkit_libdevice() is None:
        pytest.skip("no CUDA toolkit libdevice here: GELUs take torch's bits from a table after a model's check")
    from laya_pool.kernels.exact import gelu_differs
    if gelu_differs(torch.device("cuda"), table=False) > 0:
        pytest.skip("this toolkit's erff is not torch's either: GELUs take the table after a model's check")
    assert _first_gemm_differs() == 0
    own = Path(triton.__file__).parent / "backends/nvidia/lib/libdevice.10.bc"
    planted = _first_gemm_differs({"TRITON_LIBDEVICE_PATH": str(own)})
    print(f"\nGELU outputs unlike torch's with Triton's own libdevice: {planted}")
    if planted == 0:
        pytest.skip("Triton's own libdevice gives torch's bits here: nothing to plant")
