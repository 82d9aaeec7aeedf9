#!/usr/bin/env python3
"""Device probe: which ops give a row a different result when the batch around it is padded differently."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
dev = "cuda"
d, ff = 1024, 5248
for dt in (torch.bfloat16, torch.float32):
    w = torch.randn(ff, d, device=dev, dtype=dt) / d ** 0.5
    x = torch.randn(16 * 512, d, device=dev, dtype=dt)
    base = F.linear(x[:48], w)
    for m in (64, 128, 512, 2048, 8192):
        out = F.linear(x[:m], w)[:48]
        diff = (out - base).abs().max().item()
        print(f"linear {dt} M=48 vs M={m}: equal={torch.equal(out, base)} maxdiff={diff:.3g}")
    # fixed-size chunks through bmm
    C = 128

    def chunked(xx, C=C, w=w):
        n = xx.shape[0]
        pad = -n % C
        xp = F.pad(xx, (0, 0, 0, pad)).view(-1, C, d)
        return torch.matmul(xp, w.t()).view(-1, ff)[:n]
    cb = chunked(x[:48])
    for m in (64, 128, 512, 2048, 8192):
        out = chunked(x[:m])[:48]
        print(f"chunked128 {dt} M={m}: equal={torch.equal(out, cb)}")
    # attention with padded keys
    q = torch.randn(1, 16, 48, 64, device=dev, dtype=dt)
    k = torch.randn(1, 16, 48, 64, device=dev, dtype=dt)
    v = torch.randn(1, 16, 48, 64, device=dev, dtype=dt)
    a0 = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(1, 1, 48, 48, dtype=torch.bool, device=dev))
    for L in (64, 128, 512):
        qp, kp, vp = (F.pad(t, (0, 0, 0, L - 48)) for t in (q, k, v))
        mask = torch.zeros(1, 1, L, L, dtype=torch.bool, device=dev)
        mask[..., :48] = True
        a = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)[:, :, :48]
        print(f"sdpa {dt} L=48 vs L={L}: equal={torch.equal(a, a0)} maxdiff={(a - a0).abs().max().item():.3g}")
    ln0 = F.layer_norm(x[:48].float(), (d,))
    print(f"layer_norm M=48 vs 8192 equal={torch.equal(F.layer_norm(x.float(), (d,))[:48], ln0)}")
