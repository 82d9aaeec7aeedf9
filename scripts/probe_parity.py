#!/usr/bin/env python3
"""Device probe: where the fast path's bf16 numbers leave the SDK's, op by op and tap by tap.

    python3 scripts/probe_parity.py --model /tmp/large [--out DIR]

ops: each fast-path kernel against the torch op sequence the SDK's bf16 autocast runs (cuBLAS linear, fp32
LayerNorm, SDPA with a boolean mask), fed the same inputs taken from a real forward: the fraction of bf16
outputs that differ, and each one's distance to an fp32 truth. An op that rounds where the SDK does not
shows many more differing elements than a GEMM's accumulation order alone explains.
taps: whole forwards, fast vs the reference (invariant GEMMs, the worker path) vs the reference on cuBLAS
(the SDK's bits) vs fp32: relative distance per tap and the answers' |dp|.
bisect (PARITY_BISECT=1, after ops): one encoder layer of a packed batch op by op, each fast kernel fed the SDK's
previous output (the residual stream from the SDK's own forward's tap before the layer, packed as a worker packs):
where in a whole forward the fast path first leaves the SDK's bits when every op on `ops`' single row does not.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

# The checkout root, for laya_pool where it is not installed.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from laya_pool.kernels import rows as rk  # noqa: E402
from laya_pool.kernels.attention import attention, sdk_masks  # noqa: E402
from laya_pool.kernels.fast import FastModel  # noqa: E402
from laya_pool.kernels.gemm import Epi, gemm  # noqa: E402
from laya_pool.kernels.reference import ReferenceModel, _rotate_half  # noqa: E402
from laya_pool.worker.checkpoint import load_checkpoint  # noqa: E402


def batch(lens, k=8, seed=0, vocab=1000):
    rng = np.random.default_rng(seed)
    ids = np.concatenate([rng.integers(5, vocab, n) for n in lens]).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
    mk = np.full((len(lens), k), -1, np.int32)
    for r, n in enumerate(lens):
        mk[r, :6] = np.linspace(1, n - 1, 6).astype(np.int32)
    t = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    return dict(ids=t(ids), row_start=t(starts), row_len=t(np.array(lens, np.int32)),
                qtype=t(np.arange(len(lens), dtype=np.int32) % 3), markers=t(mk), max_row_len=max(lens))


def differ(a, b, truth=None) -> dict:
    a, b = a.float(), b.float()
    out = {"differ": float((a != b).float().mean()), "nrms": float((a - b).norm() / b.norm().clamp_min(1e-30))}
    if truth is not None:
        t = truth.float()
        out["fast_vs_truth"] = float((a - t).norm() / t.norm())
        out["sdk_vs_truth"] = float((b - t).norm() / t.norm())
    return out


def ops(ck, fast, n=512):
    """One row of n tokens through layer 5's ops, inputs from the cuBLAS reference's taps."""
    a = ck.arch
    ref = ReferenceModel(a, ck.tensors, device="cuda", dtype=torch.bfloat16, gemm="vendor")
    inp = batch([n])
    taps = {}
    ref(**inp, taps=taps)
    i = next(j for j in range(2, a.layers) if not a.is_global(j))      # a local layer
    g = next(j for j in range(2, a.layers) if a.is_global(j))
    h = taps[f"encoder.{i - 1}"][0].contiguous()                        # [n, d] fp32
    lay = fast.layers[i]
    d, H, D = a.hidden, a.heads, a.head_dim
    res = {}
    # LayerNorm
    x = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
    rk.layer_norm(h, lay["attn_norm"], None, x, a.norm_eps)
    x_sdk = F.layer_norm(h, (d,), lay["attn_norm"], None, a.norm_eps)
    res["layer_norm"] = differ(x, x_sdk.bfloat16(), x_sdk)
    x = x_sdk.bfloat16()
    # QKV GEMM (plain) and with RoPE
    w_qkv = ref.layers[i]["Wqkv"]
    qkv_sdk = F.linear(x, w_qkv)
    truth = F.linear(x.float(), w_qkv.float())
    out = torch.empty_like(qkv_sdk)
    gemm(x, w_qkv, out)
    res["gemm_plain_qkv"] = differ(out, qkv_sdk, truth)
    cos, sin = ref.rope[lay["theta"]]

    def rope_sdk(y):        # y [n, 3d] bf16 -> q, k rotated (as ref._rope), v as is
        v = y.view(n, 3, H, D)
        q, k = (((v[:, j].float() * cos[:n, None]) + _rotate_half(v[:, j].float()) * sin[:n, None]).bfloat16()
                for j in (0, 1))
        return torch.stack([q, k, v[:, 2]], 1).reshape(n, 3 * d)
    pos = torch.arange(n, device="cuda", dtype=torch.int32)
    fc, fs = fast.rope[lay["theta"]]
    gemm(x, lay["Wqkv_pairs"], out, epi=Epi.ROPE, rope=(pos, fc, fs, D, 2 * H))
    res["gemm_rope"] = differ(out, rope_sdk(qkv_sdk))
    res["rope_alone_on_sdk_qkv"] = differ(rope_sdk(qkv_sdk), rope_sdk(qkv_sdk))   # 0 by construction: a control
    qkv = rope_sdk(qkv_sdk)
    # attention, local and global, on the same qkv
    rs = torch.zeros(1, device="cuda", dtype=torch.int32)
    rl = torch.full((1,), n, device="cuda", dtype=torch.int32)
    q, k, v = (qkv.view(n, 3, H, D)[:, j].transpose(0, 1)[None] for j in range(3))   # [1, H, n, D]
    p = torch.arange(n, device="cuda")
    for name, win in (("attention_local", a.half_window), ("attention_global", None)):
        band = (p[:, None] - p[None, :]).abs() <= (n if win is None else win)
        mask = band
        o_sdk = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=D ** -0.5)
        o_true = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask[None, None],
                                                scale=D ** -0.5)
        o = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
        attention(qkv, o, rs, rl, H, D, n, win, D ** -0.5)
        flat = lambda t: t[0].transpose(0, 1).reshape(n, d)  # noqa: E731
        res[name] = differ(o, flat(o_sdk), flat(o_true))
        if name == "attention_local":       # which SDPA kernel the SDK's call runs (cuDNN or mem-eff differ)
            try:
                res["sdpa backend"] = int(torch._fused_sdp_choice(q, k, v, mask[None, None], 0.0, False, D ** -0.5))
            except Exception as e:  # noqa: BLE001 - a private torch function: report, never fail the probe
                res["sdpa backend"] = repr(e)[:120]
        # The math backend rounds like a plain bf16 matmul chain; which SDPA kernel does the SDK's call pick?
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            o_math = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=D ** -0.5)
        res[name + "_sdpa_math_vs_default"] = differ(flat(o_math), flat(o_sdk), flat(o_true))
    att = flat(o_sdk)
    # Wo + residual
    hh = h.clone()
    gemm(att, lay["Wo"], hh, epi=Epi.RESIDUAL)
    h_sdk = h + F.linear(att, lay["Wo"]).float()
    res["gemm_residual"] = differ(hh, h_sdk, h + F.linear(att.float(), lay["Wo"].float()))
    # GeGLU
    x2 = F.layer_norm(h_sdk, (d,), lay["mlp_norm"], None, a.norm_eps).bfloat16()
    inner = torch.empty(n, a.intermediate, device="cuda", dtype=torch.bfloat16)
    gemm(x2, lay["Wi"], inner, epi=fast.geglu)         # the fast model's Wi: in `geglu_pairs` order by default
    wi = ref.layers[i]["Wi"]                             # the checkpoint's order: [input; gate]
    u, gt = F.linear(x2, wi).chunk(2, -1)
    u32, g32 = F.linear(x2.float(), wi.float()).chunk(2, -1)
    res["gemm_geglu"] = differ(inner, F.gelu(u) * gt, F.gelu(u32) * g32)
    res["layer"] = {"local": i, "global": g}
    return res


class LayerInputs:
    """Layer `layer`'s inputs in a packed batch of rows `lens`, as the SDK's own forward makes them: the residual
    stream from its tap before the layer, packed as a worker packs, and its attention's q, k, v, mask and output."""

    def __init__(self, ck, fast, sdk, lens, layer: int, got: dict, inp: dict):
        a = ck.arch
        L = max(lens)
        self.inp, self.lens = inp, lens
        self.valid = valid = torch.arange(L, device="cuda")[None, :] < inp["row_len"][:, None].long()      # [R, L]
        self.pos = torch.cat([torch.arange(n, device="cuda", dtype=torch.int32) for n in lens])
        self.h = got[f"encoder.{layer - 1}"][valid].contiguous()                                  # [T, d] packed
        T, d = self.h.shape
        H, D = a.heads, a.head_dim
        ref = sdk.layers[layer]
        self.x_sdk = F.layer_norm(self.h, (d,), ref["attn_norm"], None, a.norm_eps).bfloat16()
        q, k, v = (self.pad(F.linear(self.x_sdk, ref["Wqkv"]).view(T, 3, H, D)[:, j]).transpose(1, 2)
                   for j in range(3))
        theta = fast.layers[layer]["theta"]
        self.q, self.k, self.v = sdk._rope(q, theta, L), sdk._rope(k, theta, L), v              # [R, H, L, D]
        self.qkv_sdk = torch.stack([t.transpose(1, 2)[valid] for t in (self.q, self.k, self.v)], 1).reshape(T, 3 * d)
        self.window = None if a.is_global(layer) else a.half_window
        every, band = sdk_masks(valid, a.half_window)
        self.mask = every if self.window is None else band
        self.scale = D ** -0.5
        self.att_sdk = self.sdpa()

    def pad(self, x):                               # packed [T, ...] -> [R, L, ...] (zeros past a row's end)
        out = x.new_zeros(tuple(self.valid.shape) + x.shape[1:])
        out[self.valid] = x
        return out

    def sdpa(self, mask=None):                      # the SDK's attention call, packed [T, H * D]
        att = F.scaled_dot_product_attention(self.q, self.k, self.v, attn_mask=self.mask if mask is None else mask,
                                             scale=self.scale)
        return att.transpose(1, 2)[self.valid].reshape(self.h.shape[0], -1)

    def ours(self, heads: int, head_dim: int):
        att = torch.empty_like(self.att_sdk)
        attention(self.qkv_sdk, att, self.inp["row_start"], self.inp["row_len"], heads, head_dim,
                  max(self.lens), self.window, self.scale)
        return att


def bisect(ck, fast, lens, layer: int) -> dict:
    """Layer `layer` op by op on the rows `lens` packed back to back (module docstring); fraction of outputs that
    differ from the SDK's op on the same input, real tokens only."""
    a = ck.arch
    sdk = ReferenceModel(a, ck.tensors, device="cuda", dtype=torch.bfloat16, gemm="vendor")
    inp = batch(lens, seed=len(lens))
    got = {}
    sdk(**inp, taps=got)
    li = LayerInputs(ck, fast, sdk, lens, layer, got, inp)
    h, x_sdk, qkv_sdk, valid, pad = li.h, li.x_sdk, li.qkv_sdk, li.valid, li.pad
    T, d = h.shape
    L, H, D = max(lens), a.heads, a.head_dim
    lay, ref = fast.layers[layer], sdk.layers[layer]
    res = {}
    x = torch.empty(T, d, device="cuda", dtype=torch.bfloat16)
    rk.layer_norm(h, lay["attn_norm"], None, x, a.norm_eps)
    res["attn_norm"] = differ(x, x_sdk)
    qkv = torch.empty(T, 3 * d, device="cuda", dtype=torch.bfloat16)
    cos, sin = fast.rope[lay["theta"]]
    gemm(x_sdk, lay["Wqkv_pairs"], qkv, epi=Epi.ROPE, rope=(li.pos, cos, sin, D, 2 * H))
    res["qkv_rope"] = differ(qkv, qkv_sdk)
    att, att_sdk = li.ours(H, D), li.att_sdk
    res["attention"] = differ(att, att_sdk)
    for blk in range(-(-L // 128)):                 # where the differing outputs sit: by key block of the query
        sel = pad(torch.ones(T, device="cuda", dtype=torch.bool))
        sel[:, : blk * 128] = False
        sel[:, (blk + 1) * 128:] = False
        sel = sel[valid]
        if bool(sel.any()):
            res[f"attention, queries {blk * 128}-{blk * 128 + 127}"] = differ(att[sel], att_sdk[sel])
    hh = h.clone()
    gemm(att_sdk, lay["Wo"], hh, epi=Epi.RESIDUAL)
    h_sdk = h + F.linear(att_sdk, ref["Wo"]).float()
    res["wo_residual"] = differ(hh, h_sdk)
    x2 = torch.empty(T, d, device="cuda", dtype=torch.bfloat16)
    rk.layer_norm(h_sdk, lay["mlp_norm"], None, x2, a.norm_eps)
    x2_sdk = F.layer_norm(h_sdk, (d,), ref["mlp_norm"], None, a.norm_eps).bfloat16()
    res["mlp_norm"] = differ(x2, x2_sdk)
    inner = torch.empty(T, a.intermediate, device="cuda", dtype=torch.bfloat16)
    gemm(x2_sdk, lay["Wi"], inner, epi=fast.geglu)     # the fast model's Wi: in `geglu_pairs` order by default
    u, gt = F.linear(x2_sdk, ref["Wi"]).chunk(2, dim=-1)
    inner_sdk = F.gelu(u) * gt
    res["geglu"] = differ(inner, inner_sdk)
    h2 = h_sdk.clone()
    gemm(inner_sdk, lay["Wo_mlp"], h2, epi=Epi.RESIDUAL)
    h2_sdk = h_sdk + F.linear(inner_sdk, ref["Wo_mlp"]).float()
    res["wo_mlp_residual"] = differ(h2, h2_sdk)
    res["layer out: SDK ops here vs the SDK's forward"] = differ(h2_sdk, got[f"encoder.{layer}"][valid])
    return res


def taps(ck, fast, shapes):
    a = ck.arch
    refs = {"worker": ReferenceModel(a, ck.tensors, device="cuda", dtype=torch.bfloat16),
            "sdk": ReferenceModel(a, ck.tensors, device="cuda", dtype=torch.bfloat16, gemm="vendor"),
            "fp32": ReferenceModel(a, ck.tensors, device="cuda", dtype=torch.float32, gemm="vendor")}
    out = {}
    for lens in shapes:
        inp = batch(lens, seed=len(lens))
        got = {"fast": {}}
        fast(**inp, taps=got["fast"])
        for k, m in refs.items():
            got[k] = {}
            m(**inp, taps=got[k])
        names = [n for n in got["sdk"] if n in got["fast"]]
        rows = {}
        valid = (torch.arange(max(lens), device="cuda")[None, :] < inp["row_len"][:, None].long())
        for name in names:
            t = got["fp32"][name].float()
            sel = (lambda x, v=valid: x[v]) if t.dim() == 3 else (lambda x: x)  # noqa: E731
            t = sel(t)
            rows[name] = {k: float((sel(got[k][name].float()) - sel(got["sdk"][name].float())).norm()
                                   / sel(got["sdk"][name].float()).norm().clamp_min(1e-30))
                          for k in ("fast", "worker", "fp32")}
        present = inp["markers"] >= 0
        for k in ("fast", "worker", "fp32"):
            pk = torch.softmax(got[k]["logits"].float(), -1)
            ps = torch.softmax(got["sdk"]["logits"].float(), -1)
            rows[f"dp_{k}"] = float((pk - ps)[present].abs().max())
            rows[f"argmax_{k}"] = float((pk.argmax(-1) == ps.argmax(-1)).float().mean())
        out["x".join(map(str, lens))] = rows
        print("x".join(map(str, lens)), flush=True)
        for name, r in rows.items():
            print(f"  {name:14s} {r}" if isinstance(r, dict) else f"  {name:14s} {r:.5f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = ap.parse_args()
    ck = load_checkpoint(args.model)
    fast = FastModel(ck.arch, ck.tensors, device="cuda")
    result = {"ops": ops(ck, fast)}
    for name, r in result["ops"].items():
        print(f"{name:36s} {r}", flush=True)
    if os.environ.get("PARITY_BISECT") == "1":
        result["bisect"] = {}
        for lens in ([200, 130, 96], [512, 512]):
            for layer in (1, 2, 3):
                key = f"{'x'.join(map(str, lens))} layer {layer}"
                result["bisect"][key] = bisect(ck, fast, lens, layer)
                print(key, flush=True)
                for name, r in result["bisect"][key].items():
                    print(f"  {name:44s} {r['differ']:.3g}", flush=True)
    if os.environ.get("PARITY_OPS_ONLY") == "1":
        return
    result["taps"] = taps(ck, fast, [[48], [200, 130, 96], [512, 512]])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_parity.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
