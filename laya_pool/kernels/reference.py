"""The Laya forward in plain torch: the in-house oracle, and the eager path on CPU.

Semantics are the official SDK's `DecisionModel` in eval mode (a ModernBERT encoder plus the typed
decision head); the code is ours and imports nothing but torch and `kernels.arch`.

Inputs are PACKED rows (`docs/interfaces.md`): token ids back to back, one `row_start`/`row_len` per
row. Internally the rows are scattered into a padded `[R, max_row_len]` layout, and padding and the
sliding window become boolean attention masks. Everything in `forward` is shape-static and free of
host synchronisation (no `.item()`, no boolean indexing, no branching on tensor values), so a worker
can capture it into a CUDA graph for one `(T_cap, R_cap, K_cap, max_row_len)` shape.

Precision: `dtype=torch.float32` runs everything in fp32. `dtype=torch.bfloat16` follows what the
SDK's CUDA bf16 autocast does, op for op: every linear layer (weights, biases, outputs) and attention
in bf16; LayerNorms, the residual stream, RoPE, softmaxes and the confidence features in fp32. The
token embedding table stays fp32 as under autocast (an embedding lookup is not autocast): measured on
the H200 a bf16 table moved answers 1.7x further from the SDK's bf16 path than its own bf16-vs-fp32
noise, while an fp32 table sits at that noise floor.

GEMMs: `gemm="invariant"` (the default; what workers run) uses kernels/linear.py's batch-invariant
kernel on CUDA, so eager and graph execution agree bit for bit. `gemm="vendor"` uses cuBLAS, as the
SDK does: fed one request's rows at the SDK's padded length it reproduces the SDK's bf16 bits, which
is how the parity test separates our semantics from GEMM rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .arch import Arch
from .attention import sdk_masks
from .linear import linear

__all__ = ["ReferenceModel", "ABSENT_LOGIT", "HEAD_NORM_EPS", "load_weights", "weight_bytes"]

ABSENT_LOGIT = -1e4        # the SDK's fill for a marker a row does not have
HEAD_NORM_EPS = 1e-5       # nn.TransformerEncoderLayer / nn.LayerNorm default, used by the whole decision head


def _rope_tables(n: int, dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, dim] in fp32, computed the way HF ModernBERT does (rotate_half layout)."""
    # The inverse frequencies are computed on the CPU, as the SDK's encoder builds them before it is
    # moved: CUDA's pow rounds differently in the last bit for some thetas (10000 on the H200), and
    # that one bit in a sliding layer's RoPE was the first place our bf16 forward left the SDK's.
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    inv_freq = inv_freq.to(device)
    pos = torch.arange(n, device=device, dtype=torch.float)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def load_weights(model, arch: Arch, tensors: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
    """Put a checkpoint's tensors on `model` under the names both forwards use (this one and kernels/fast.py):
    matmul operands and their biases in `dtype`; the embedding table, norms and residual-stream additions in
    fp32, as the SDK's autocast leaves them."""
    missing = sorted(set(arch.tensor_shapes()) - set(tensors))
    if missing:
        raise KeyError(f"missing tensor {missing[0]!r}")

    def mat(name: str) -> torch.Tensor:      # matmul operands (and their biases): compute dtype
        return tensors[name].to(device=device, dtype=dtype).contiguous()

    def f32(name: str) -> torch.Tensor:      # norms, residual-stream additions: fp32
        return tensors[name].to(device=device, dtype=torch.float32).contiguous()

    a = arch
    model.tok_emb = f32("encoder.embeddings.tok_embeddings.weight")   # not autocast in the SDK either
    model.emb_norm = f32("encoder.embeddings.norm.weight")
    model.layers = []
    for i in range(a.layers):
        p = f"encoder.layers.{i}."
        model.layers.append({
            "attn_norm": f32(p + "attn_norm.weight") if i > 0 else None,
            "Wqkv": mat(p + "attn.Wqkv.weight"),
            "Wo": mat(p + "attn.Wo.weight"),
            "mlp_norm": f32(p + "mlp_norm.weight"),
            "Wi": mat(p + "mlp.Wi.weight"),
            "Wo_mlp": mat(p + "mlp.Wo.weight"),
            "global": a.is_global(i),
            "theta": a.theta(i),
        })
    model.final_norm = f32("encoder.final_norm.weight")
    model.head = []
    for j in range(a.head_layers):
        p = f"head.layers.{j}."
        model.head.append({
            "in_w": mat(p + "self_attn.in_proj_weight"), "in_b": mat(p + "self_attn.in_proj_bias"),
            "out_w": mat(p + "self_attn.out_proj.weight"), "out_b": mat(p + "self_attn.out_proj.bias"),
            "l1_w": mat(p + "linear1.weight"), "l1_b": mat(p + "linear1.bias"),
            "l2_w": mat(p + "linear2.weight"), "l2_b": mat(p + "linear2.bias"),
            "n1_w": f32(p + "norm1.weight"), "n1_b": f32(p + "norm1.bias"),
            "n2_w": f32(p + "norm2.weight"), "n2_b": f32(p + "norm2.bias"),
        })
    model.type_emb = f32("type_emb.weight")   # added to the fp32 residual stream, as the SDK does
    model.sc_norm_w, model.sc_norm_b = f32("scorer.0.weight"), f32("scorer.0.bias")
    model.sc1_w, model.sc1_b = mat("scorer.1.weight"), mat("scorer.1.bias")
    model.sc3_w, model.sc3_b = mat("scorer.3.weight"), mat("scorer.3.bias")
    model.act0_w, model.act0_b = mat("act_head.0.weight"), mat("act_head.0.bias")
    model.act2_w, model.act2_b = mat("act_head.2.weight"), mat("act_head.2.bias")


def weight_bytes(model, extra: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes of the tensors `load_weights` put on `model`, plus `extra` (a forward's own tables)."""
    m = model
    seen = [m.tok_emb, m.emb_norm, m.final_norm, m.type_emb, m.sc_norm_w, m.sc_norm_b,
            m.sc1_w, m.sc1_b, m.sc3_w, m.sc3_b, m.act0_w, m.act0_b, m.act2_w, m.act2_b, *extra]
    for lay in m.layers + m.head:
        seen += [t for t in lay.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in seen)


class ReferenceModel:
    """Plain-torch Laya forward over packed rows. See the module docstring and docs/interfaces.md."""

    def __init__(self, arch: Arch, tensors: dict[str, torch.Tensor], device="cpu", dtype=torch.float32,
                 gemm: str = "invariant"):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        if gemm not in ("invariant", "vendor"):
            raise ValueError(f"gemm must be 'invariant' or 'vendor', got {gemm!r}")
        self.invariant = gemm == "invariant"
        self.arch = arch
        self.device = torch.device(device)
        self.dtype = dtype
        load_weights(self, arch, tensors, self.device, dtype)
        dev = self.device
        a = arch

        # Static tables, built once so forward() allocates nothing that needs the host.
        self.max_positions = a.max_len
        self.rope = {}
        for theta in sorted({a.theta(i) for i in range(a.layers)}):
            self.rope[theta] = _rope_tables(self.max_positions, a.head_dim, theta, dev)
        self.positions = torch.arange(self.max_positions, device=dev)

    # ------------------------------------------------------------------ helpers

    def _lin(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
             bias_apart: bool = False) -> torch.Tensor:
        # Batch-invariant on CUDA (kernels/linear.py): a row's result must not depend on how the
        # request was padded, or eager and graph execution would disagree in the last bit.
        return linear(x.to(w.dtype).contiguous(), w, b, invariant=self.invariant, bias_apart=bias_apart)

    def _norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps)

    def _rope(self, x: torch.Tensor, theta: float, n: int) -> torch.Tensor:
        cos, sin = self.rope[theta]
        cos, sin = cos[:n], sin[:n]                       # [L, D], broadcast over [R, H, L, D]
        xf = x.float()
        return (xf * cos + _rotate_half(xf) * sin).to(self.dtype)

    # ------------------------------------------------------------------ forward

    @torch.no_grad()
    def forward(self, ids, row_start, row_len, qtype, markers, max_row_len: int,
                taps: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        L = int(max_row_len)
        if not 0 < L <= self.max_positions:
            raise ValueError(f"max_row_len {L} must be in 1..{self.max_positions}")
        tok, keep = self._scatter(ids, row_start, row_len, L)
        # ---- attention masks (True = may attend), [R, 1, L, L]
        global_ok, local_ok = sdk_masks(keep, self.arch.half_window)
        h = self._encode(tok, global_ok, local_ok, taps)
        h = self._decide(h, qtype, global_ok, taps)
        logits, present = self._score(h, markers)
        act_probs = self._act(h, logits, present)
        if taps is not None:
            taps["logits"] = logits
            taps["act"] = act_probs
        return logits, act_probs

    def _scatter(self, ids, row_start, row_len, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed rows scattered into [R, L] token ids, and which positions a row keeps."""
        dev = self.device
        pos = self.positions[:L]                                             # [L]
        row_start = row_start.to(device=dev, dtype=torch.long)
        row_len = row_len.to(device=dev, dtype=torch.long)
        valid = pos[None, :] < row_len[:, None]                              # [R, L] real tokens
        # A padding row (length 0) keeps its first position "valid" internally: every softmax then
        # has at least one key, so its outputs are finite garbage instead of NaN.
        keep = valid | (pos[None, :] == 0)
        flat = ids.to(device=dev, dtype=torch.long).reshape(-1)
        gidx = (row_start[:, None] + pos[None, :]).clamp(0, flat.shape[0] - 1)
        tok = torch.where(valid, flat[gidx], torch.full_like(gidx, self.arch.pad_id))
        return tok, keep

    def _encode(self, tok, global_ok, local_ok, taps: dict | None) -> torch.Tensor:
        """The encoder: [R, L] token ids -> [R, L, d] fp32 hidden states, final norm applied."""
        a = self.arch
        R, L = tok.shape
        d, H, D = a.hidden, a.heads, a.head_dim
        h = self._norm(F.embedding(tok, self.tok_emb), self.emb_norm, None, a.norm_eps)   # [R, L, d] fp32
        if taps is not None:
            taps["embeddings"] = h.float()
        scale = D ** -0.5
        for i, lay in enumerate(self.layers):
            x = h if lay["attn_norm"] is None else self._norm(h, lay["attn_norm"], None, a.norm_eps)
            qkv = self._lin(x, lay["Wqkv"]).view(R, L, 3, H, D)
            q, k, v = (qkv[:, :, n].transpose(1, 2) for n in range(3))        # [R, H, L, D]
            q = self._rope(q, lay["theta"], L)
            k = self._rope(k, lay["theta"], L)
            att = F.scaled_dot_product_attention(q, k, v.to(self.dtype),
                                                 attn_mask=global_ok if lay["global"] else local_ok,
                                                 scale=scale)
            att = att.transpose(1, 2).reshape(R, L, d)
            h = h + self._lin(att, lay["Wo"]).float()
            x = self._norm(h, lay["mlp_norm"], None, a.norm_eps)
            inp, gate = self._lin(x, lay["Wi"]).chunk(2, dim=-1)
            h = h + self._lin(F.gelu(inp) * gate, lay["Wo_mlp"]).float()
            if taps is not None:
                taps[f"encoder.{i}"] = h.float()
        h = self._norm(h, self.final_norm, None, a.norm_eps)
        if taps is not None:
            taps["final_norm"] = h.float()
        return h

    def _decide(self, h, qtype, global_ok, taps: dict | None) -> torch.Tensor:
        """The decision head: pre-norm TransformerEncoderLayers with key padding, ReLU MLP, over h + type_emb."""
        a = self.arch
        R, L, d = h.shape
        qt = qtype.to(device=self.device, dtype=torch.long)
        h = h + self.type_emb[qt][:, None, :]
        HH = a.head_heads
        HD = d // HH
        # The SDK's head attention projects a batch-first view transposed to (L, R, d). For R > 1 that
        # view is not contiguous, and torch's linear then rounds x @ W.T before adding the bias (matmul,
        # then add_) instead of fusing the bias into the GEMM; for R == 1 it fuses. With cuBLAS we follow
        # the rule; the batch-invariant path must not depend on R, so it always rounds apart (the
        # SDK's case for every request of two or more questions).
        apart = True if self.invariant else R > 1
        for j, lay in enumerate(self.head):
            x = self._norm(h, lay["n1_w"], lay["n1_b"], HEAD_NORM_EPS)
            qkv = self._lin(x, lay["in_w"], lay["in_b"], bias_apart=apart).view(R, L, 3, HH, HD)
            q, k, v = (qkv[:, :, n].transpose(1, 2) for n in range(3))
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=global_ok, scale=HD ** -0.5)
            att = att.transpose(1, 2).reshape(R, L, d)
            h = h + self._lin(att, lay["out_w"], lay["out_b"], bias_apart=apart).float()
            x = self._norm(h, lay["n2_w"], lay["n2_b"], HEAD_NORM_EPS)
            h = h + self._lin(F.relu(self._lin(x, lay["l1_w"], lay["l1_b"])), lay["l2_w"], lay["l2_b"]).float()
            if taps is not None:
                taps[f"head.{j}"] = h.float()
        return h

    def _score(self, h, markers) -> tuple[torch.Tensor, torch.Tensor]:
        """The scorer at the [MASK] markers: one logit per option [R, K] (absent markers ABSENT_LOGIT), and which
        markers are present."""
        R, L, d = h.shape
        K = markers.shape[1]
        mk = markers.to(device=self.device, dtype=torch.long)
        present = mk >= 0                                                    # [R, K]
        midx = mk.clamp(0, L - 1)
        m = torch.gather(h, 1, midx[:, :, None].expand(R, K, d))             # [R, K, d] fp32
        m = self._norm(m, self.sc_norm_w, self.sc_norm_b, HEAD_NORM_EPS)
        m = F.gelu(self._lin(m, self.sc1_w, self.sc1_b))
        logits = self._lin(m, self.sc3_w, self.sc3_b).squeeze(-1).float()
        return logits.masked_fill(~present, ABSENT_LOGIT), present

    def _act(self, h, logits, present) -> torch.Tensor:
        """The confidence features and the act head (fp32 features, as the SDK computes them): [R, n_act] probs."""
        # The confidence features reduce over the markers. Reduce over one fixed width (padding slots
        # hold exp(-1e4 - max) == 0) so the summation order, and so every bit, is the same whatever
        # marker width the caller or a graph bucket padded the request to.
        wide = F.pad(logits, (0, self.max_positions + 1 - logits.shape[1]), value=ABSENT_LOGIT)
        p = torch.softmax(wide, -1)
        kf = present.sum(-1).clamp(min=2).float()
        ent = -(p * torch.log(p.clamp_min(1e-9))).sum(-1) / torch.log(kf)
        top = p.topk(2, -1).values                   # a single marker's top2 is a padding slot: 0
        top1, top2 = top[:, 0], top[:, 1]
        feats = torch.stack([top1, top1 - top2, ent, kf / 255.0], -1)
        act_in = torch.cat([h[:, 0].float(), feats], -1)
        act = self._lin(F.gelu(self._lin(act_in, self.act0_w, self.act0_b)), self.act2_w, self.act2_b)
        return torch.softmax(act.float(), -1)

    __call__ = forward

    def parameter_bytes(self) -> int:
        """Bytes of weights this model holds on its device (for a worker's memory report)."""
        return weight_bytes(self)
