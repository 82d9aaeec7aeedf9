"""The production forward on CUDA: packed rows end to end, Triton kernels, bf16 with an fp32 residual stream.

Same inputs and outputs as `kernels.reference.ReferenceModel.forward` (docs/interfaces.md), same semantics
(the SDK's `DecisionModel` in eval mode under bf16 autocast), different execution: the tokens stay packed
(`T = rows x max_row_len` slots, of which the rows' real tokens are a prefix), so no op runs on padding
inside a row. Per encoder layer seven kernels: LayerNorm, QKV GEMM with RoPE in its epilogue, banded or global
attention, output GEMM adding into the residual, LayerNorm, GeGLU GEMM, down GEMM adding into the residual.
Attention is ours by default (`attention="triton"`, kernels/attention.py: packed, no masks, a local layer only its
band), in the SDK's bits (cuDNN's order: docs/decisions/0004-attention-in-cudnns-order.md);
`attention="sdpa"` runs torch's SDPA itself on the SDK's padded layout and masks (the same bits, 0.25 ms slower at
1x48 and 2.2 ms at 16x512). The decision head follows the same pattern with biases; the scorer and the act head
close with a handful of small kernels.

Every kernel is batch-invariant (kernels/gemm.py, kernels/attention.py, kernels/rows.py say how), so eager,
fixed-graph and cached-graph execution, and a request merged with others, give the same bits. Everything
here is shape-static and free of host synchronisation, so a worker can capture it into a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from laya_pool.protocol import settings

from . import cublas, exact
from . import rows as rk
from .arch import Arch
from .attention import Rows, attention_sdpa
from .attention import attention as banded
from .gemm import SPLIT_MAX_M, Act, Epi, geglu_pairs, gemm, k_chunk, residual, rope_pairs
from .reference import ABSENT_LOGIT, HEAD_NORM_EPS, _rope_tables, load_weights, weight_bytes

__all__ = ["ATTENTION", "FastModel", "act_at", "supports"]

# "triton": kernels/attention.py, packed and banded; "sdpa": torch's SDPA on the SDK's layout. Both the SDK's bits.
ATTENTION = ("sdpa", "triton")


def supports(arch: Arch, device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the fast path runs this model here, else why not (the caller falls back to the reference)."""
    from .gemm import triton
    interpreted = settings.get("TRITON_INTERPRET")     # Triton's CPU interpreter: tests only
    if triton is None or (device.type != "cuda" and not interpreted):
        return "the fast path needs CUDA and Triton"
    if dtype != torch.bfloat16 and not (interpreted and dtype == torch.float16):
        # fp16 exists for Triton's CPU interpreter alone, which cannot run bf16 dots: the tests check the
        # fast path's indexing and fusion in fp16 on the CPU, and its bf16 numbers on the GPU.
        return f"the fast path runs bf16 only, not {dtype}"
    if arch.head_layers < 1:
        return "the fast path enters the decision head through its first layer's norm; this model has none"
    if arch.head_dim not in (16, 32, 64, 128) or arch.hidden % 64 or arch.hidden > rk.MAX_WIDTH:
        return f"head_dim {arch.head_dim} / hidden {arch.hidden} is not a supported shape"
    return None


class _Taps:
    """Eager-only debugging: copies of the packed residual stream, laid out [R, L, d] as the reference's taps."""

    def __init__(self, taps: dict | None, row_start: torch.Tensor, row_len: torch.Tensor, max_row_len: int):
        self.taps = taps
        if taps is not None:
            pos = torch.arange(max_row_len, device=row_start.device)
            self.valid = pos[None, :] < row_len[:, None].long()
            self.index = (row_start[:, None].long() + pos[None, :]) * self.valid

    def __call__(self, name: str, h: torch.Tensor) -> None:
        if self.taps is not None:
            self.taps[name] = h[self.index].float() * self.valid[..., None]


def act_at(rows: int, row_markers: int) -> int:
    """Where a forward's act starts in its answers buffer (float32 elements): after the logits [rows, row_markers],
    64-byte aligned. A worker's slot holds its outputs the same way (worker/workspace.py), so one copy reads both."""
    return -(-rows * row_markers // 16) * 16


@dataclass
class _Scratch:
    """One forward's buffers (`FastModel._scratch`)."""
    h: torch.Tensor                  # the residual stream, fp32 [T, d]
    x: torch.Tensor                  # the normed input of the next GEMM [T, d]
    qkv_spare: torch.Tensor          # [T + 1, 3d]: the QKV product, row T attention_sdpa's padding (zero)
    spare: torch.Tensor              # [T + 1, d]: attention's output, row T attention_sdpa's padding slots
    mid: torch.Tensor                # [T, max(intermediate, 4d)]: the GeGLU / head MLP's inner activations
    pos: torch.Tensor                # each token's position in its row
    row: torch.Tensor                # each token's row
    parts: torch.Tensor | None       # chunk sums of split residual GEMMs
    product: torch.Tensor | None     # cuBLAS's residual products waiting for the next LayerNorm
    rows: Rows | None                # attention_sdpa's padded layout


class FastModel:
    """bf16 Laya forward on CUDA over packed rows (see the module docstring)."""

    def __init__(self, arch: Arch, tensors: dict[str, torch.Tensor], device="cuda", dtype=torch.bfloat16,
                 attention: str | None = None):
        why = supports(arch, torch.device(device), dtype)
        if why:
            raise ValueError(why)
        attention = attention or settings.get("LAYA_ATTN")
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r} (LAYA_ATTN)")
        self.attention = attention
        self.arch, self.device, self.dtype = arch, torch.device(device), dtype
        load_weights(self, arch, tensors, self.device, dtype)
        # The toolkit's libdevice and the GELU check (kernels/exact.py), before any kernel of ours compiles; the
        # table is made now if needed: a capture must find it made.
        self.exactness = exact.prepare(self.device)
        a, dev = arch, self.device
        # RoPE tables [max_len, D/2] in fp32, built as the reference (and the SDK) builds them.
        self.max_positions = a.max_len
        half = a.head_dim // 2
        self.rope = {}
        for theta in sorted({a.theta(i) for i in range(a.layers)}):
            cos, sin = _rope_tables(self.max_positions, a.head_dim, theta, dev)
            self.rope[theta] = (cos[:, :half].contiguous(), sin[:, :half].contiguous())
        # cuBLAS's products where proven to give our bits (kernels/cublas.py); its QKV product needs the checkpoint's
        # row order, kept beside the paired one (6 MB a layer of the large preset).
        self.products = cublas.Products(self.device) if self.device.type == "cuda" else None
        # The GeGLU GEMM: one accumulator over Wi's input and gate rows interleaved (GEGLU_PAIRS), or two accumulators
        # over Wi as the checkpoint holds it (LAYA_GEGLU=two); the same bits (kernels/gemm.py).
        self.geglu = Epi.GEGLU if settings.get("LAYA_GEGLU") == "two" else Epi.GEGLU_PAIRS
        for lay in self.layers:        # the QKV GEMM's RoPE epilogue reads its rows in pairs (kernels/gemm.py)
            lay["Wqkv_pairs"] = rope_pairs(lay["Wqkv"], a.head_dim)
            if self.geglu == Epi.GEGLU_PAIRS:
                lay["Wi"] = geglu_pairs(lay["Wi"])
            if self.products is None:
                del lay["Wqkv"]
        # Whether any residual GEMM has K chunks (kernels/gemm.py), which a chunk-sum workspace then holds.
        ks = [a.hidden, a.intermediate] + ([4 * a.hidden] if self.head else [])
        self.max_chunks = 2 if any(k_chunk(k) for k in ks) else 1

    @torch.no_grad()
    def forward(self, ids, row_start, row_len, qtype, markers, max_row_len: int,
                taps: dict | None = None, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`tokens`: how many packed token slots to compute; every row must lie inside them. The default,
        rows x max_row_len (at most the ids given), holds any batch packed back to back from slot 0, which
        is how a worker packs (worker/workspace.py)."""
        dev = self.device
        L = int(max_row_len)
        if not 0 < L <= self.max_positions:
            raise ValueError(f"max_row_len {L} must be in 1..{self.max_positions}")
        R = row_start.shape[0]
        T = min(R * L, ids.shape[0]) if tokens is None else int(tokens)
        row_start = row_start.to(dev, torch.int32)
        row_len = row_len.to(dev, torch.int32)
        qtype = qtype.to(dev, torch.int32)
        markers = markers.to(dev, torch.int32).contiguous()
        ids = ids.to(dev, torch.int32)
        s = self._scratch(T, row_start, row_len, L, taps is None)
        rk.embed(ids, row_start, row_len, self.tok_emb, self.emb_norm, s.h, s.x, s.pos, s.row, self.arch.pad_id,
                 self.arch.norm_eps)
        tap = _Taps(taps, row_start, row_len, L)
        tap("embeddings", s.h)
        pending = self._encoder(s, row_start, row_len, L, tap)
        if taps is not None:
            tap("final_norm", torch.nn.functional.layer_norm(s.h, (self.arch.hidden,), self.final_norm, None,
                                                             self.arch.norm_eps))
        self._head(s, row_start, row_len, qtype, L, pending, tap)
        logits, act_probs = self._answers(s.h, row_start, markers, L)
        if taps is not None:
            taps["logits"], taps["act"] = logits, act_probs
        return logits, act_probs

    def _scratch(self, T: int, row_start: torch.Tensor, row_len: torch.Tensor, L: int, fused: bool) -> _Scratch:
        """The forward's buffers for T token slots. `fused`: no taps, which read h between layers, so split residual
        GEMMs may leave chunk sums and cuBLAS's products may wait for the next LayerNorm."""
        a, dev, cd, empty = self.arch, self.device, self.dtype, torch.empty
        d = a.hidden
        ff = max(a.intermediate, 4 * d if self.head else 0)
        qkv_spare = empty((T + 1, 3 * d), device=dev, dtype=cd)     # row T: attention_sdpa's padding, zero
        spare = empty((T + 1, d), device=dev, dtype=cd)             # attention_sdpa writes padding slots to row T
        # Chunk sums of split residual GEMMs, added by the next row kernel (kernels/gemm.py); none where M is too large
        # to split.
        parts = None
        if fused and self.max_chunks > 1 and T <= SPLIT_MAX_M:
            parts = empty((self.max_chunks, T, d), device=dev, dtype=torch.float32)
        # cuBLAS's residual products wait here for the next LayerNorm (kernels/cublas.py); only where it may run
        product = None
        if self.products is not None and fused and cublas.wanted(T):
            product = empty((1, T, d), device=dev, dtype=cd)
        rows = Rows(row_start, row_len, L, T, a.half_window, cd) if self.attention == "sdpa" else None
        if rows is not None:
            qkv_spare[T].zero_()
        return _Scratch(h=empty((T, d), device=dev, dtype=torch.float32), x=empty((T, d), device=dev, dtype=cd),
                        qkv_spare=qkv_spare, spare=spare, mid=empty((T, ff), device=dev, dtype=cd),
                        pos=empty(T, device=dev, dtype=torch.int32), row=empty(T, device=dev, dtype=torch.int32),
                        parts=parts, product=product, rows=rows)

    def _encoder(self, s: _Scratch, row_start, row_len, L: int, tap: _Taps):
        """The encoder layers on s.h; returns what the head's entry kernel still has to add (a `Pending`, or None)."""
        a = self.arch
        H, D = a.heads, a.head_dim
        qkv, att = s.qkv_spare[:-1], s.spare[:-1]
        pending = None
        for i, lay in enumerate(self.layers):
            if lay["attn_norm"] is not None:       # layer 0 has none, and nothing pending before it
                rk.layer_norm(s.h, lay["attn_norm"], None, s.x, a.norm_eps, pending)
            cos, sin = self.rope[lay["theta"]]
            self._qkv(s.x, lay, qkv, (s.pos, cos, sin, D, 2 * H))
            if s.rows is not None:
                attention_sdpa(s.qkv_spare, s.spare, s.rows, H, D, D ** -0.5, local=not lay["global"])
            else:
                banded(qkv, att, row_start, row_len, H, D, L, None if lay["global"] else a.half_window, D ** -0.5)
            pending = self._residual(att, lay["Wo"], s.h, s.parts, s.product, lay["mlp_norm"])
            rk.layer_norm(s.h, lay["mlp_norm"], None, s.x, a.norm_eps, pending)
            inner = s.mid[:, : a.intermediate]
            gemm(s.x, lay["Wi"], inner, epi=self.geglu)
            # The last layer's is ours: the head's entry kernel, not a proven LayerNorm, adds what it leaves.
            last = i == len(self.layers) - 1
            pending = self._residual(inner, lay["Wo_mlp"], s.h, s.parts, None if last else s.product,
                                     lay["mlp_norm"])
            tap(f"encoder.{i}", s.h)
        return pending

    def _head(self, s: _Scratch, row_start, row_len, qtype, L: int, pending, tap: _Taps) -> None:
        """The decision head on s.h: h <- final_norm(h) + type_emb; pre-norm layers, biases rounded as the SDK
        rounds them."""
        a = self.arch
        HH = a.head_heads
        HD = a.hidden // HH
        qkv, att = s.qkv_spare[:-1], s.spare[:-1]
        for j, lay in enumerate(self.head):
            if j == 0:
                rk.head_entry(s.h, s.row, qtype, self.final_norm, self.type_emb, lay["n1_w"], lay["n1_b"], s.x,
                              a.norm_eps, HEAD_NORM_EPS, pending)
            else:
                rk.layer_norm(s.h, lay["n1_w"], lay["n1_b"], s.x, HEAD_NORM_EPS, pending)
            gemm(s.x, lay["in_w"], qkv, bias=lay["in_b"], bias_apart=True)
            if s.rows is not None:
                attention_sdpa(s.qkv_spare, s.spare, s.rows, HH, HD, HD ** -0.5)
            else:
                banded(qkv, att, row_start, row_len, HH, HD, L, None, HD ** -0.5)
            pending = residual(att, lay["out_w"], s.h, s.parts, bias=lay["out_b"], bias_apart=True)
            rk.layer_norm(s.h, lay["n2_w"], lay["n2_b"], s.x, HEAD_NORM_EPS, pending)
            inner = s.mid[:, : 4 * a.hidden]
            gemm(s.x, lay["l1_w"], inner, bias=lay["l1_b"], act=Act.RELU)
            # The last one finishes in place: what reads h next (the scorer's gathers) adds no chunk sums.
            last = j == len(self.head) - 1
            pending = residual(inner, lay["l2_w"], s.h, None if last else s.parts, bias=lay["l2_b"])
            tap(f"head.{j}", s.h)

    def _answers(self, h: torch.Tensor, row_start, markers, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The scorer at the [MASK] markers, the confidence features and the act head: (logits [R, K], act [R, n_act]),
        views of one buffer."""
        a, dev, cd, empty = self.arch, self.device, self.dtype, torch.empty
        R, K, d = row_start.shape[0], markers.shape[1], a.hidden
        m = empty((R * K, d), device=dev, dtype=cd)
        rk.gather_norm(h, row_start, markers, self.sc_norm_w, self.sc_norm_b, m, L, HEAD_NORM_EPS)
        m2 = empty((R * K, d), device=dev, dtype=cd)
        gemm(m, self.sc1_w, m2, bias=self.sc1_b, act=Act.GELU)
        score = empty((R * K, 1), device=dev, dtype=cd)
        gemm(m2, self.sc3_w, score, bias=self.sc3_b)
        # The two answers in one buffer (`act_at`): a worker's slot holds them so, and reads both back in one copy.
        at = act_at(R, K)
        answers = empty((at + R * a.n_act,), device=dev, dtype=torch.float32)
        logits = answers[: R * K].view(R, K)
        act_in = empty((R, d + 16), device=dev, dtype=cd)   # d + 4 used; a 16-aligned row stride
        rk.features(score, markers, h, row_start, logits, act_in, ABSENT_LOGIT, self.max_positions + 1)
        hid = empty((R, self.act0_w.shape[0]), device=dev, dtype=cd)
        gemm(act_in[:, : d + 4], self.act0_w, hid, bias=self.act0_b, act=Act.GELU)
        act = empty((R, a.n_act), device=dev, dtype=cd)
        gemm(hid, self.act2_w, act, bias=self.act2_b)
        act_probs = answers[at: at + R * a.n_act].view(R, a.n_act)
        rk.softmax_rows(act, act_probs)
        return logits, act_probs

    __call__ = forward

    def _qkv(self, x, lay, out, rope) -> None:
        """out <- the QKV GEMM with RoPE: cuBLAS's product where proven equal to ours at this shape, else ours."""
        if self.products is not None and cublas.wanted(x.shape[0]):
            w = lay["Wqkv"]
            if self.products.use(cublas.key("qkv", x, w, out), lambda: self._prove_qkv(x, lay, out, rope)):
                cublas.qkv(x, w, out, rope)
                return
        gemm(x, lay["Wqkv_pairs"], out, epi=Epi.ROPE, rope=rope)

    def _residual(self, a, w, h, parts, product, norm):
        """h += a @ w.T now, or the `Pending` the next LayerNorm adds (`residual`'s or cuBLAS's, where proven)."""
        if product is not None:
            if self.products.use(cublas.key("residual", a, w, product),
                                 lambda: self._prove_residual(a, w, h, product, norm)):
                return cublas.residual(a, w, product)
        return residual(a, w, h, parts)

    def _prove_qkv(self, x, lay, out, rope) -> bool:
        """Our fused QKV GEMM and cuBLAS's product + `rotate` on random rows laid out as x and out: equal bits?"""
        pos, cos, sin, head_dim, heads = rope
        x1 = cublas.like(x, random=True)
        g = torch.Generator(pos.device).manual_seed(1)
        pos1 = torch.randint(0, self.max_positions, pos.shape, generator=g, device=pos.device, dtype=pos.dtype)
        ours, theirs = cublas.like(out), cublas.like(out)
        gemm(x1, lay["Wqkv_pairs"], ours, epi=Epi.ROPE, rope=(pos1, cos, sin, head_dim, heads))
        cublas.qkv(x1, lay["Wqkv"], theirs, (pos1, cos, sin, head_dim, heads))
        return torch.equal(ours, theirs)

    def _prove_residual(self, a, w, h, product, norm) -> bool:
        """Our residual GEMM then a LayerNorm, against cuBLAS's product added by that LayerNorm, on random rows laid
        out as a and h: equal residual stream and equal normed rows?"""
        a1 = cublas.like(a, random=True)
        h0 = cublas.like(h, random=True)
        h1, h2 = h0.clone(), h0.clone()
        x1 = torch.empty(h0.shape, device=h.device, dtype=self.dtype)
        x2 = torch.empty_like(x1)
        rk.layer_norm(h1, norm, None, x1, self.arch.norm_eps, residual(a1, w, h1, None))
        rk.layer_norm(h2, norm, None, x2, self.arch.norm_eps, cublas.residual(a1, w, cublas.like(product)))
        return torch.equal(h1, h2) and torch.equal(x1, x2)

    def parameter_bytes(self) -> int:
        return weight_bytes(self, tuple(t for pair in self.rope.values() for t in pair))
