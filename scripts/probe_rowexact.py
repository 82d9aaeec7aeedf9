#!/usr/bin/env python3
"""Device probe: do the fast path's row ops give torch's bits? LayerNorm (kernels/rows.py) and GELU (the GeGLU and
scorer epilogues of kernels/gemm.py), each against the torch op the SDK runs, on the same inputs.

    python3 scripts/probe_rowexact.py [--model /tmp/large] [--out DIR]

layer_norm: rows of widths 128, 768 and 1024, with and without a bias, random (normal, and with outliers as a
residual stream has) and, with --model, the large model's own residual stream (taps of the SDK-order reference):
how many fp32 outputs differ from F.layer_norm's. gelu: every bf16 value through kernels/exact.py's `gelu` against
F.gelu on bf16, and Triton's erf alone over fp32 values. The control, the same norm in another order, must differ,
or equality proves nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))   # last: see probe_parity.py

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from laya_pool.kernels import exact  # noqa: E402
from laya_pool.kernels import rows as rk  # noqa: E402


def ln_case(h: torch.Tensor, w, b, eps: float) -> dict:
    x = torch.empty_like(h)                     # fp32 out: every bit of the norm, before the bf16 rounding
    rk.layer_norm(h.clone(), w, b, x, eps)
    ref = F.layer_norm(h, (h.shape[1],), w, b, eps)
    xb = torch.empty(h.shape, device=h.device, dtype=torch.bfloat16)
    rk.layer_norm(h.clone(), w, b, xb, eps)
    return {"rows": h.shape[0], "fp32_differ": float((x != ref).float().mean()),
            "bf16_differ": float((xb != ref.bfloat16()).float().mean()),
            "max_abs": float((x - ref).abs().max())}


def layer_norms(model: str | None) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for n in (128, 768, 1024):
        w = torch.rand(n, device="cuda", generator=g) + 0.5
        b = torch.randn(n, device="cuda", generator=g) * 0.1
        plain = torch.randn(4096, n, device="cuda", generator=g) * 2 + 0.3
        spiky = plain.clone()
        spiky[:, :: max(1, n // 8)] *= 40                  # a residual stream's few large channels
        for name, h in (("normal", plain), ("outliers", spiky)):
            out[f"{n} {name}"] = ln_case(h, w, None, 1e-5)
            out[f"{n} {name} bias"] = ln_case(h, w, b, 1e-5)
        # The control: the same norm in another order (two passes, torch ops) must differ, or equality proves nothing.
        ref = F.layer_norm(spiky, (n,), w, None, 1e-5)
        mean = spiky.mean(1, keepdim=True)
        two_pass = (spiky - mean) * torch.rsqrt(((spiky - mean) ** 2).mean(1, keepdim=True) + 1e-5) * w
        out[f"{n} control: two-pass order vs torch, fp32 outputs that differ"] = float((ref != two_pass).float().mean())
    if model:
        from laya_pool.kernels.reference import ReferenceModel
        from laya_pool.worker.checkpoint import load_checkpoint
        ck = load_checkpoint(model)
        ref = ReferenceModel(ck.arch, ck.tensors, device="cuda", dtype=torch.bfloat16, gemm="vendor")
        lens = [512, 200, 130, 96]
        ids = torch.randint(5, 1000, (sum(lens),), device="cuda", dtype=torch.int32, generator=g)
        starts = torch.tensor([0, 512, 712, 842], device="cuda", dtype=torch.int32)
        mk = torch.full((4, 8), -1, device="cuda", dtype=torch.int32)
        mk[:, 0] = 1
        taps = {}
        ref(ids, starts, torch.tensor(lens, device="cuda", dtype=torch.int32),
            torch.zeros(4, device="cuda", dtype=torch.int32), mk, 512, taps=taps)
        a = ck.arch
        for i in (0, 5, 13, 27):
            h = taps[f"encoder.{i}"].reshape(-1, a.hidden).contiguous()     # padding slots too: rows all the same
            out[f"model encoder.{i} -> mlp_norm of {i + 1 if i + 1 < a.layers else i}"] = ln_case(
                h, ref.layers[min(i + 1, a.layers - 1)]["mlp_norm"], None, a.norm_eps)
        head = ref.head[0]
        out["model head n1 (bias, eps 1e-5 head)"] = ln_case(h, head["n1_w"], head["n1_b"], 1e-5)
        # probe_parity.py's case (one 512-token row of encoder.1 into layer 2's attention norm), where a version
        # that reduced with tl.reduce differed; and the embedding LayerNorm inside a whole fast forward.
        out["model encoder.1 row 0 -> attn_norm of 2"] = ln_case(taps["encoder.1"][0].contiguous(),
                                                               ref.layers[2]["attn_norm"], None, a.norm_eps)
        from laya_pool.kernels.fast import FastModel
        fast_taps = {}
        FastModel(a, ck.tensors, device="cuda")(ids, starts, torch.tensor(lens, device="cuda", dtype=torch.int32),
                                                 torch.zeros(4, device="cuda", dtype=torch.int32), mk, 512,
                                                 taps=fast_taps)
        e_ref, e_fast = taps["embeddings"], fast_taps["embeddings"]
        real = e_fast.abs().sum(-1) > 0                     # the fast taps hold real tokens only (zeros elsewhere)
        out["model embeddings, whole fast forward"] = {
            "rows": int(real.sum()), "fp32_differ": float((e_fast[real] != e_ref[real]).float().mean()),
            "bf16_differ": float((e_fast[real].bfloat16() != e_ref[real].bfloat16()).float().mean()),
            "max_abs": float((e_fast[real] - e_ref[real]).abs().max())}
        del ref
    return out


@triton.jit
def _erf_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    tl.store(y_ptr + i, tl.math.erf(tl.load(x_ptr + i, mask=ok, other=0.0)), mask=ok)


def gelus() -> dict:
    found = exact.prepare(torch.device("cuda"))      # what a fast model does at load: libdevice, then the check
    x = exact.bf16_values(torch.device("cuda"))
    out = {"prepare": found, "gelu bf16: values": x.numel(),
           "gelu bf16: differ": exact.gelu_differs(x.device, table=False),
           "gelu bf16: differ with the table": exact.gelu_differs(x.device, table=True)}
    xf = torch.cat([torch.linspace(-6, 6, 1 << 24, device="cuda"), torch.randn(1 << 22, device="cuda") * 3])
    yf = torch.empty_like(xf)
    _erf_kernel[(triton.cdiv(xf.numel(), 1024),)](xf, yf, xf.numel(), BLOCK=1024)
    bad = yf != torch.erf(xf)
    out.update({"erf fp32: values": xf.numel(), "erf fp32: differ": int(bad.sum()),
                "erf fp32: first inputs that differ": [float(v) for v in xf[bad][:8].cpu()]})
    return out


def speed() -> dict:
    from triton.testing import do_bench
    out = {}
    for t in (48, 1536, 8192):
        h = torch.randn(t, 1024, device="cuda")
        w = torch.rand(1024, device="cuda")
        x = torch.empty(t, 1024, device="cuda", dtype=torch.bfloat16)
        ours = do_bench(lambda h=h, w=w, x=x: rk.layer_norm(h, w, None, x, 1e-5), warmup=20, rep=200)
        theirs = do_bench(lambda h=h, w=w: F.layer_norm(h, (1024,), w, None, 1e-5), warmup=20, rep=200)
        out[f"layer_norm ms, {t} x 1024: ours / torch"] = [round(ours, 4), round(theirs, 4)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--out")
    args = ap.parse_args()
    exact.prepare(torch.device("cuda"))     # before any kernel compiles, as a fast model's load does
    res = {"layer_norm": layer_norms(args.model), "gelu": gelus(), "speed": speed()}
    print(json.dumps(res, indent=1))
    if args.out:
        with open(os.path.join(args.out, "rowexact.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
