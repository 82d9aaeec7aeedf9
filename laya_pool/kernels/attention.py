"""Attention over packed rows: no padding, no mask tensors, the sliding window as a band.

The input is the QKV projection of packed tokens, `[T, 3 * H * D]` (query heads, key heads, value heads),
with rows given by `row_start`/`row_len`. One program takes one block of a row's queries for one head and
walks that row's keys in blocks; a local layer walks only the blocks that meet the ±window band of its
queries, a global layer (and the decision head) every block of the row's real length. Padding tokens and
other rows are never read.

Bits: this is SDPA's (cuDNN's, the SDK's attention) online softmax in cuDNN's own order, which the device probes
found piece by piece (docs/PERF.md, tenth and eleventh sessions): scores in log2 units,
blocks of 128 keys from the row's start, and cuDNN's row sum: each thread of an MMA quad carries its own sum of its
columns (8j + 2t + c) across key blocks, the block's partial added to the rescaled carry in one FMA, the quad's four
joined (t0 + t1) + (t2 + t3) only at the end. 0 of 11.2 M outputs differ from the SDK's SDPA call on a global and a
local layer (eleventh session, call 3). The order holds for the tiles measured (64 queries, 128 keys, 4 warps).

Batch invariance: key blocks are aligned to the row's own start (keys 0..BN-1 of the row, then BN..2BN-1,
...), so a query's keys are reduced in one order whatever else is in the batch and wherever the row sits
in the packed buffer. A key block that holds no visible key for a query is an exact no-op for it (the
running max starts finite, so its rescale factor is exactly 1 and its probabilities exactly 0): the query
block size may therefore change without changing any result. There is no split over keys.
"""
from __future__ import annotations

import torch

from .launch import dispatch, launch, settle_keys

try:
    import triton
    import triton.language as tl

    from .launch import wait_turn
except ImportError:  # CPU-only installs have no Triton; only the CUDA path needs it
    triton = None

LOG2E = 1.4426950408889634
# Keys are reduced in blocks of 128 from the row's start: the block torch's SDPA kernels use, so a query's online
# softmax rescales at the same keys as the SDK's attention and rounds to the same bits (device probe of
# 2026-12-03: 0 of 512x1024 outputs differ from SDPA's on a local layer, 4e-6 on a
# global one; blocks of 64 left 12-15% of the outputs one bf16 ulp apart, and the answers 8x further from the SDK).
KEY_BLOCK = 128
# Queries per program, warps, pipeline stages. The query block never changes a bit (module docstring); 8 warps keep
# the MMA's column-to-thread map (two warpgroups stacked over the queries), so the row sum keeps cuDNN's order.
TILE = (64, 4, 2)


if triton is not None:
    @triton.jit
    def _group_sum(p, g, G: tl.constexpr):
        """The sum over one quad thread's columns (8j + 2G + c) of a row, in Triton's own in-thread order (cuDNN's):
        the other threads' columns add exact zeros, so the quad's shuffle adds nothing to it."""
        return tl.sum(tl.where((g == G)[None, :], p, 0.0), 1)

    @triton.jit
    def _attention_kernel(qkv_ptr, out_ptr, start_ptr, len_ptr, qk_scale, H, sq, so,
                          WINDOW: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          USE_GDC: tl.constexpr):
        r, qb, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        # The rows' bounds are inputs no kernel writes: read while the kernels before finish, not after them (device
        # run of 2026-12-04, seventeenth session, call 4: attention 116 -> 105 us a 1x48 replay, 277 -> 265 at 32x48).
        n = tl.load(len_ptr + r)
        start = tl.load(start_ptr + r).to(tl.int64)
        wait_turn(USE_GDC)   # kernels/launch.py: every earlier kernel done before touching memory
        q0 = qb * BM
        if q0 < n:
            qi = q0 + tl.arange(0, BM)
            q_ok = qi < n
            d = tl.arange(0, D)
            base = qkv_ptr + start * sq
            q = tl.load(base + qi[:, None] * sq + h * D + d[None, :], mask=q_ok[:, None], other=0.0)
            if WINDOW >= 0:
                lo = (tl.maximum(q0 - WINDOW, 0) // BN) * BN
                hi = tl.minimum(n, q0 + BM + WINDOW)
            else:
                lo = 0
                hi = n
            m_i = tl.full((BM,), -1.0e30, tl.float32)      # finite: a block with no visible key is a no-op
            acc = tl.zeros((BM, D), tl.float32)
            l0 = tl.zeros((BM,), tl.float32)                # the row sum, one part per quad thread (docstring)
            l1 = tl.zeros((BM,), tl.float32)
            l2 = tl.zeros((BM,), tl.float32)
            l3 = tl.zeros((BM,), tl.float32)
            g = (tl.arange(0, BN) % 8) // 2                 # the quad thread that holds a column
            for b in range(0, tl.cdiv(hi - lo, BN)):
                kj = lo + b * BN + tl.arange(0, BN)
                k_ok = kj < n
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
                l0 = tl.fma(l0, alpha, _group_sum(p, g, 0))
                l1 = tl.fma(l1, alpha, _group_sum(p, g, 1))
                l2 = tl.fma(l2, alpha, _group_sum(p, g, 2))
                l3 = tl.fma(l3, alpha, _group_sum(p, g, 3))
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            l_i = (l0 + l1) + (l2 + l3)
            o = acc / l_i[:, None]
            tl.store(out_ptr + (start + qi[:, None]) * so + h * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=q_ok[:, None])


def attention(qkv: torch.Tensor, out: torch.Tensor, row_start: torch.Tensor, row_len: torch.Tensor,
              heads: int, head_dim: int, max_row_len: int, window: int | None, scale: float) -> torch.Tensor:
    """out[T, H*D] <- softmax(q k^T * scale) v within each row; `window` = half width of the band or None.

    Tokens outside every row are left as they are (never read by a real row downstream). The SDK's bits (module
    docstring)."""
    rows, (bm, warps, stages) = row_start.shape[0], TILE
    grid = (rows, triton.cdiv(max_row_len, bm), heads)
    args = (qkv, out, row_start, row_len, scale * LOG2E, heads, qkv.stride(0), out.stride(0))
    dispatch(_attention_kernel, grid, args,
             dict(WINDOW=-1 if window is None else int(window), D=head_dim, BM=bm, BN=KEY_BLOCK,
                  **launch(qkv.device, grid[0] * grid[1] * grid[2]), num_warps=warps, num_stages=stages), qkv.device)
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
    the [R, H, L, D] layout and masks the SDK's attention gets (`Rows`): the SDK's bits, as `attention`'s (device
    probes of 2026-12-04), slower (it reads every key block of the padded row, and the masks). `qkv` is
    [T + 1, 3 * H * D] with row T zero: padding slots read it, so a masked key's value is finite (its weight is
    exactly 0, and 0 times a stale NaN would not be); `out` is [T + 1, H * D], row T takes the padding slots'
    outputs."""
    R, L = rows.valid.shape
    x = qkv.index_select(0, rows.slot).view(R, L, 3, heads, head_dim)
    q, k, v = (x[:, :, n].transpose(1, 2) for n in range(3))                          # [R, H, L, D]
    # (torch.nn.functional looked up here, not imported with the module: kernels/compile.py `defer_torch` says why)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    att = sdpa(q, k, v, attn_mask=rows.band if local else rows.mask, scale=scale)
    out.index_copy_(0, rows.slot, att.transpose(1, 2).reshape(R * L, heads * head_dim))
    return out


# Every Triton function's cache key now, in definition order (launch.settle_keys says why).
settle_keys(globals())
