"""Attention over packed rows: no padding, no mask tensors, the sliding window as a band.

The input is the QKV projection of packed tokens, `[T, 3 * H * D]` (query heads, key heads, value heads),
with rows given by `row_start`/`row_len`. One program takes one block of a row's queries for one head and
walks that row's keys in blocks; a local layer walks only the blocks that meet the ±window band of its
queries, a global layer (and the decision head) every block of the row's real length. Padding tokens and
other rows are never read.

Bits: this is SDPA's (cuDNN's, the SDK's attention) online softmax in the orders the device probes found
(scripts/probe_attn_bits.py: scores in log2 units, blocks of 128 keys from the row's start; with PERM and ROUND_SUM,
not yet the defaults, a block's row sum with cuDNN's pairing and the running sum's product rounded apart, which
give its bits on rows of one key block). Longer rows differ in ~3-6e-6 of outputs, by one bf16 ulp, so the fast
path runs SDPA itself by default (kernels/fast.py).

Batch invariance: key blocks are aligned to the row's own start (keys 0..BN-1 of the row, then BN..2BN-1,
...), so a query's keys are reduced in one order whatever else is in the batch and wherever the row sits
in the packed buffer. A key block that holds no visible key for a query is an exact no-op for it (the
running max starts finite, so its rescale factor is exactly 1 and its probabilities exactly 0): the query
block size may therefore change without changing any result. There is no split over keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import exact
from .launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs have no Triton; only the CUDA path needs it
    triton = None

LOG2E = 1.4426950408889634
# Keys are reduced in blocks of 128 from the row's start: the block torch's SDPA kernels use, so a query's online
# softmax rescales at the same keys as the SDK's attention and rounds to the same bits (device probe of
# 2026-12-03, scripts/probe_parity.py: 0 of 512x1024 outputs differ from SDPA's on a local layer, 4e-6 on a
# global one; blocks of 64 left 12-15% of the outputs one bf16 ulp apart, and the answers 8x further from the SDK).
KEY_BLOCK = 128


if triton is not None:
    @triton.jit
    def _thread_sums(p, BM: tl.constexpr, BN: tl.constexpr, C_MAJOR: tl.constexpr):
        """Probe (CARRY=1, 5): the sums each thread t of an MMA quad holds over its columns 8j + 2t + c, each in
        sequence (j, then c; C_MAJOR: c, then j), [BM, 4]. A select and a sum per column: slow, exact in order."""
        p4 = tl.reshape(p, (BM, BN // 8, 4, 2))
        jj = tl.arange(0, BN // 8)[None, :, None, None]
        cc = tl.arange(0, 2)[None, None, None, :]
        acc = tl.zeros((BM, 4), tl.float32)
        if C_MAJOR:
            for c in range(2):
                for j in range(BN // 8):
                    acc = acc + tl.sum(tl.sum(tl.where((jj == j) & (cc == c), p4, 0.0), 3), 1)
        else:
            for j in range(BN // 8):
                for c in range(2):
                    acc = acc + tl.sum(tl.sum(tl.where((jj == j) & (cc == c), p4, 0.0), 3), 1)
        return acc

    @triton.jit
    def _group_sum(p, g, G: tl.constexpr):
        """The sum over one quad thread's columns (8j + 2G + c) of a row, in Triton's own in-thread order: the other
        threads' columns add exact zeros, so the quad's shuffle adds nothing to it."""
        return tl.sum(tl.where((g == G)[None, :], p, 0.0), 1)

    @triton.jit
    def _attention_kernel(qkv_ptr, out_ptr, start_ptr, len_ptr, qk_scale, H, sq, so,
                          WINDOW: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          USE_GDC: tl.constexpr, PERM: tl.constexpr = False, ROUND_SUM: tl.constexpr = False,
                          TWO_PASS: tl.constexpr = False, CARRY: tl.constexpr = 0, STEP: tl.constexpr = 128):
        if USE_GDC:   # kernels/launch.py: wait for every earlier kernel before touching memory
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        r, qb, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = tl.load(len_ptr + r)
        q0 = qb * BM
        if q0 < n:
            start = tl.load(start_ptr + r).to(tl.int64)
            qi = q0 + tl.arange(0, BM)
            q_ok = qi < n
            d = tl.arange(0, D)
            base = qkv_ptr + start * sq
            q = tl.load(base + qi[:, None] * sq + h * D + d[None, :], mask=q_ok[:, None], other=0.0)
            if WINDOW >= 0:
                lo = (tl.maximum(q0 - WINDOW, 0) // STEP) * STEP
                hi = tl.minimum(n, q0 + BM + WINDOW)
            else:
                lo = 0
                hi = n
            m_i = tl.full((BM,), -1.0e30, tl.float32)      # finite: a block with no visible key is a no-op
            l_i = tl.zeros((BM,), tl.float32)
            acc = tl.zeros((BM, D), tl.float32)
            lq = tl.zeros((BM, 4), tl.float32)              # CARRY's per-thread sums (1, 5)
            l0 = tl.zeros((BM,), tl.float32)                # ... and (2-4), one per quad thread
            l1 = tl.zeros((BM,), tl.float32)
            l2 = tl.zeros((BM,), tl.float32)
            l3 = tl.zeros((BM,), tl.float32)
            g = (tl.arange(0, BN) % 8) // 2                 # the quad thread that holds a column
            if TWO_PASS:
                # Probe: each row's maximum over all its keys first, so the loop below never rescales (its factor
                # is exactly 1): the bits of a softmax that sees the whole row before it exponentiates.
                for b in range(0, tl.cdiv(hi - lo, STEP)):
                    kj = lo + b * STEP + tl.arange(0, BN)
                    k_ok = kj < n
                    if STEP != BN:
                        k_ok = k_ok & (tl.arange(0, BN) < STEP)
                    k = tl.load(base + kj[:, None] * sq + (H + h) * D + d[None, :], mask=k_ok[:, None], other=0.0)
                    s = tl.dot(q, tl.trans(k)) * qk_scale
                    seen = k_ok[None, :]
                    if WINDOW >= 0:
                        gap = qi[:, None] - kj[None, :]
                        seen = seen & (gap <= WINDOW) & (gap >= -WINDOW)
                    m_i = tl.maximum(m_i, tl.max(tl.where(seen, s, float("-inf")), 1))
            for b in range(0, tl.cdiv(hi - lo, STEP)):
                kj = lo + b * STEP + tl.arange(0, BN)
                if PERM:
                    # Keys 2,3 and 4,5 of every 8 swap places: Triton's row sum then pairs the four partial sums of
                    # an MMA quad as cuDNN's does, (s0 + s1) + (s2 + s3). The swap inside an MMA's K changes no bit.
                    kj = (kj & ~6) | ((kj & 2) << 1) | ((kj & 4) >> 1)
                k_ok = kj < n
                if STEP != BN:      # probe: blocks of STEP keys (< BN) in a tile of BN, the rest masked
                    k_ok = k_ok & (tl.arange(0, BN) < STEP)
                k = tl.load(base + kj[:, None] * sq + (H + h) * D + d[None, :], mask=k_ok[:, None], other=0.0)
                v = tl.load(base + kj[:, None] * sq + (2 * H + h) * D + d[None, :], mask=k_ok[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k)) * qk_scale
                seen = k_ok[None, :]
                if WINDOW >= 0:
                    gap = qi[:, None] - kj[None, :]
                    seen = seen & (gap <= WINDOW) & (gap >= -WINDOW)
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.math.exp2(m_i - m_new)
                p = tl.math.exp2(s - m_new[:, None])
                if CARRY == 1 or CARRY == 5:
                    # Probe: each thread's sum carried across blocks (scaled, then its block's own partial added),
                    # the quad's four joined only at the end, (s0 + s1) + (s2 + s3). Needs PERM off.
                    lq = exact.mul(lq, alpha[:, None]) + _thread_sums(p, BM, BN, CARRY == 5)
                elif CARRY == 3:   # as 2, the product fused into the add
                    l0 = l0 * alpha + _group_sum(p, g, 0)
                    l1 = l1 * alpha + _group_sum(p, g, 1)
                    l2 = l2 * alpha + _group_sum(p, g, 2)
                    l3 = l3 * alpha + _group_sum(p, g, 3)
                elif CARRY != 0:   # 2, 4: as 1 in Triton's in-thread order, four row sums a block
                    l0 = exact.mul(l0, alpha) + _group_sum(p, g, 0)
                    l1 = exact.mul(l1, alpha) + _group_sum(p, g, 1)
                    l2 = exact.mul(l2, alpha) + _group_sum(p, g, 2)
                    l3 = exact.mul(l3, alpha) + _group_sum(p, g, 3)
                elif ROUND_SUM:   # the running sum's product rounded on its own, never fused into the add
                    l_i = exact.mul(l_i, alpha) + tl.sum(p, 1)
                else:
                    l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            if CARRY == 1 or CARRY == 5:
                t4 = tl.arange(0, 4)[None, :]
                l_i = ((tl.sum(tl.where(t4 == 0, lq, 0.0), 1) + tl.sum(tl.where(t4 == 1, lq, 0.0), 1))
                       + (tl.sum(tl.where(t4 == 2, lq, 0.0), 1) + tl.sum(tl.where(t4 == 3, lq, 0.0), 1)))
            elif CARRY == 4:
                l_i = (l0 + l2) + (l1 + l3)
            elif CARRY != 0:
                l_i = (l0 + l1) + (l2 + l3)
            o = acc / l_i[:, None]
            tl.store(out_ptr + (start + qi[:, None]) * so + h * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=q_ok[:, None])


def attention(qkv: torch.Tensor, out: torch.Tensor, row_start: torch.Tensor, row_len: torch.Tensor,
              heads: int, head_dim: int, max_row_len: int, window: int | None, scale: float,
              **variant) -> torch.Tensor:
    """out[T, H*D] <- softmax(q k^T * scale) v within each row; `window` = half width of the band or None.

    Tokens outside every row are left as they are (never read by a real row downstream). `variant`: the probes'
    (bm, bn, STEP, PERM, ROUND_SUM, TWO_PASS, CARRY). PERM and ROUND_SUM bring the bits nearer SDPA's (device probes of
    2026-12-04, scripts/probe_attn_bits.py: every row of one key block exact; 34 -> 18 global and 23 -> 19 local
    differing outputs of 5.6 M); not yet the defaults: their time and the gpu tests are still to run. TWO_PASS and
    CARRY are the next candidates for the rows of several key blocks, not yet run on the device.
    """
    if variant.get("CARRY") and (variant.get("PERM") or variant.get("ROUND_SUM")):
        raise ValueError("CARRY sums in the loads' own key order and rounds as it goes: not with PERM or ROUND_SUM")
    rows = row_start.shape[0]
    bm, bn = variant.pop("bm", 64), variant.pop("bn", KEY_BLOCK)
    variant.setdefault("STEP", bn)          # keys per block: the tile's width but for the probes
    grid = (rows, triton.cdiv(max_row_len, bm), heads)
    _attention_kernel[grid](qkv, out, row_start, row_len, scale * LOG2E, heads, qkv.stride(0), out.stride(0),
                            WINDOW=-1 if window is None else int(window), D=head_dim, BM=bm, BN=bn,
                            **launch(qkv.device, grid[0] * grid[1] * grid[2]), num_warps=4, num_stages=2,
                            **variant)
    return out


class Rows:
    """The packed rows laid out [R, L] for torch's attention: each slot's token (padding slots: the spare row T
    of [T + 1, ...] buffers), whether it is a real token, and the masks [R, 1, L, L] the SDK's attention gets
    (kernels/reference.py builds the same): every real key (`mask`), and the ±window band (`band`), in which a
    padding query sees every real key (its output is never read). The masks are additive, 0 or -inf in `dtype`:
    what SDPA makes of a boolean mask on every call (the same values, so the same bits), made here once per
    forward. Shape-static, no host sync."""

    def __init__(self, row_start: torch.Tensor, row_len: torch.Tensor, max_row_len: int, tokens: int,
                 half_window: int, dtype: torch.dtype):
        pos = torch.arange(max_row_len, device=row_start.device)
        self.valid = pos[None, :] < row_len[:, None]                                   # [R, L]
        self.slot = torch.where(self.valid, row_start[:, None].long() + pos[None, :], tokens).reshape(-1)
        every, band = sdk_masks(self.valid, half_window)
        self.mask, self.band = additive(every, dtype), additive(band, dtype)


def sdk_masks(keys: torch.Tensor, half_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The SDK's boolean attention masks [R, 1, L, L] (True: may attend) for rows whose real keys are `keys` [R, L]:
    every real key (global layers, the decision head), and the keys within ±half_window (local layers), in which a
    padding query sees every real key (it may have none in its window; its output is never read)."""
    L = keys.shape[1]
    pos = torch.arange(L, device=keys.device)
    near = (pos[:, None] - pos[None, :]).abs() <= half_window                        # [L, L]
    key_ok = keys[:, None, None, :]                                                  # [R, 1, 1, L]
    return key_ok.expand(-1, 1, L, -1), key_ok & (near[None, None] | ~keys[:, None, :, None])


def additive(ok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as SDPA converts it: 0 where True, -inf where False, dense."""
    return torch.zeros(ok.shape, device=ok.device, dtype=dtype).masked_fill_(~ok, float("-inf"))


def attention_sdpa(qkv: torch.Tensor, out: torch.Tensor, rows: Rows, heads: int, head_dim: int,
                   scale: float, local: bool = False) -> torch.Tensor:
    """out[:T] <- softmax(q k^T * scale) v over each row's real keys (the band's, `local`), by torch's own SDPA on
    the [R, H, L, D] layout and masks the SDK's attention gets (`Rows`): the SDK's bits, which `attention`'s online
    softmax misses in ~1e-5 of outputs (one fp32 ulp, device probes of 2026-12-04), a difference 28 layers carry to
    the answers. `qkv` is [T + 1, 3 * H * D] with row T zero: padding slots read it, so a masked key's value is
    finite (its weight is exactly 0, and 0 times a stale NaN would not be); `out` is [T + 1, H * D], row T takes the
    padding slots' outputs."""
    R, L = rows.valid.shape
    x = qkv.index_select(0, rows.slot).view(R, L, 3, heads, head_dim)
    q, k, v = (x[:, :, n].transpose(1, 2) for n in range(3))                          # [R, H, L, D]
    att = F.scaled_dot_product_attention(q, k, v, attn_mask=rows.band if local else rows.mask, scale=scale)
    out.index_copy_(0, rows.slot, att.transpose(1, 2).reshape(R * L, heads * head_dim))
    return out
