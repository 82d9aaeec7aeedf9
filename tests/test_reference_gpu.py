"""kernels.reference on CUDA against the SDK (fp32, and bf16 against its CUDA bf16 autocast), and CUDA graphs.

Run on the device: `python -m pytest -q -s tests/test_reference_gpu.py`. Each test prints one summary
line (prefixed `SUMMARY`) for the notes.

bf16 is checked twice. With cuBLAS GEMMs (`gemm="vendor"`) and one forward per request at the SDK's
padded length, our forward performs the SDK's operations on the SDK's kernels, so the issue's bar
holds as stated: decisions agree on >= 99.5% of questions and max |dp| <= 0.01. The worker's path
(batch-invariant GEMMs, 48-row packed chunks) rounds differently in the last bit of bf16, and on
these random-weight checkpoints many questions are near-ties, so it is held to the SDK's own noise
measured in the same run: the SDK's bf16 against itself with each question in its own forward, and
against its fp32 forward. It must agree on >= 99.5% of the decisive questions (SDK margin >= 0.1)
and stay within that noise (agreement at most 1 point below, |dp| max and mean at most 1.5x).
"""
from __future__ import annotations

import time
import warnings

import pytest
import torch
from conftest import make_ckpt
from test_reference import REQUESTS, encode, flat_rows, make_requests, pack

from laya_pool.kernels.fast import FastModel
from laya_pool.kernels.reference import ABSENT_LOGIT, ReferenceModel
from laya_pool.worker.checkpoint import load_checkpoint

pytestmark = pytest.mark.gpu

AGREE_MIN = 0.995       # decisions that must agree (fp32; bf16 on the SDK's kernels; the decisive ones otherwise)
DP_MAX = 0.01           # max |dp| in bf16 on the SDK's kernels (and on the worker path where noise is below it)
NOISE_FACTOR = 1.5      # ... and otherwise at most this multiple of that noise (max and mean |dp|)
FP32_DP_MAX = 1e-3      # fp32 on CUDA against the SDK with autocast off: the semantics, tightly
DECISIVE_MARGIN = 0.1   # a question is decisive when the SDK's top-1 leads its top-2 by this much
MIN_QUESTIONS = 200


@pytest.fixture(scope="module")
def large_ckpt(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("ckpt") / "large", preset="large")


def _sdk_cuda(path):
    laya = pytest.importorskip("laya")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya.load(str(path), device="cuda")
    assert agent.amp_enabled and agent.dtype == torch.bfloat16, (agent.amp_enabled, agent.dtype)
    return agent


def _sdk_probs(agent, groups, amp: bool) -> list[torch.Tensor]:
    """Option probabilities the way predict() computes them: one collated forward per request."""
    from laya.common import collate_items

    held = agent.amp_enabled
    agent.amp_enabled = amp
    out = []
    try:
        for g in groups:
            with torch.no_grad():
                logits, _ = agent._forward(collate_items([g], agent.tok.pad_token_id))
            out += [torch.softmax(torch.from_numpy(x[:len(it["markers"])]), -1) for x, it in zip(logits, g)]
    finally:
        agent.amp_enabled = held
    return out


def _sdk_layout_probs(ref: ReferenceModel, groups) -> list[torch.Tensor]:
    """Ours the way the SDK lays a request out: one forward per request, padded to its longest row."""
    out = []
    for g in groups:
        part = flat_rows([g])
        inputs, slots = pack(part, device="cuda")
        logits, _ = ref.forward(**inputs)
        logits = logits.float().cpu()
        out += [torch.softmax(logits[slots[r], :len(mk)], -1) for r, (_, mk, _) in enumerate(part)]
    return out


def _our_probs(ref: ReferenceModel | FastModel, rows, chunk: int = 48) -> list[torch.Tensor]:
    """Ours as a worker runs it: packed chunks of rows, a padding row and a spare marker column."""
    out: list = [None] * len(rows)
    for lo in range(0, len(rows), chunk):
        part = rows[lo:lo + chunk]
        inputs, slots = pack(part, device="cuda", pad_rows=(len(part),), extra_k=1)
        logits, act = ref.forward(**inputs)
        # Real rows only: a padding row's outputs are never read, and the fast path computes it from token slots
        # that belong to no row (uninitialised attention output; NaN has been seen there).
        real = list(slots[:len(part)])
        assert torch.isfinite(logits[real]).all() and torch.isfinite(act[real]).all()
        logits = logits.cpu()
        for r, (_, mk, _) in enumerate(part):
            assert torch.all(logits[slots[r], len(mk):] == ABSENT_LOGIT)
            out[lo + r] = torch.softmax(logits[slots[r], :len(mk)], -1)
    return out


def _margin(p: torch.Tensor) -> float:
    top = torch.cat([p, p.new_zeros(1)]).topk(2).values
    return float(top[0] - top[1])


def _dist(pa: list[torch.Tensor], pb: list[torch.Tensor], decisive: list[bool] | None = None) -> dict:
    agree = [int(a.argmax()) == int(b.argmax()) for a, b in zip(pa, pb)]
    dps = [float((a - b).abs().max()) for a, b in zip(pa, pb)]
    out = {"agree": sum(agree) / len(agree), "dp_max": max(dps), "dp_mean": sum(dps) / len(dps)}
    if decisive is not None:
        d = [a for a, keep in zip(agree, decisive) if keep]
        out["decisive"] = len(d)
        out["agree_decisive"] = sum(d) / max(1, len(d))
    return out


def _fmt(d: dict) -> str:
    s = f"agree {d['agree']:.2%}, max|dp| {d['dp_max']:.4f}, mean|dp| {d['dp_mean']:.5f}"
    if "decisive" in d:
        s += f", agree on {d['decisive']} decisive {d['agree_decisive']:.2%}"
    return s


def _worse(a: dict, b: dict) -> dict:
    return {"agree": min(a["agree"], b["agree"]), "dp_max": max(a["dp_max"], b["dp_max"]),
            "dp_mean": max(a["dp_mean"], b["dp_mean"])}


def _parity(path, label: str, n_requests: int, seed: int) -> None:
    t0 = time.perf_counter()
    agent = _sdk_cuda(path)
    ck = load_checkpoint(path)
    groups = encode(agent, REQUESTS + make_requests(n_requests, seed))
    rows = flat_rows(groups)
    assert len(rows) >= MIN_QUESTIONS
    sdk16 = _sdk_probs(agent, groups, amp=True)
    sdk16_alone = _sdk_probs(agent, [[it] for g in groups for it in g], amp=True)
    sdk32 = _sdk_probs(agent, groups, amp=False)
    del agent
    torch.cuda.empty_cache()
    ours32 = _our_probs(ReferenceModel(ck.arch, ck.tensors, device="cuda", dtype=torch.float32), rows)
    torch.cuda.empty_cache()
    vendor16 = _sdk_layout_probs(ReferenceModel(ck.arch, ck.tensors, device="cuda", dtype=torch.bfloat16,
                                                gemm="vendor"), groups)
    torch.cuda.empty_cache()
    ref16 = _our_probs(ReferenceModel(ck.arch, ck.tensors, device="cuda", dtype=torch.bfloat16), rows)
    torch.cuda.empty_cache()
    ours16 = _our_probs(FastModel(ck.arch, ck.tensors, device="cuda", attention="triton"), rows)
    torch.cuda.empty_cache()
    # torch's SDPA on the SDK's layout instead of our packed attention (LAYA_ATTN=sdpa): the same bits
    sdpa16 = _our_probs(FastModel(ck.arch, ck.tensors, device="cuda", attention="sdpa"), rows)

    decisive = [_margin(p) >= DECISIVE_MARGIN for p in sdk16]
    fp32 = _dist(ours32, sdk32)
    exact = _dist(vendor16, sdk16, decisive)
    bf16 = _dist(ref16, sdk16, decisive)               # the worker path: the reference forward on invariant GEMMs
    fast = _dist(ours16, sdk16, decisive)              # the fast path, the workers' default on CUDA
    sdpa = _dist(sdpa16, sdk16, decisive)
    batching = _dist(sdk16_alone, sdk16, decisive)     # the SDK's bf16 against itself, batched otherwise
    precision = _dist(sdk32, sdk16, decisive)          # the SDK's bf16 autocast against its fp32
    noise = _worse(batching, precision)
    print(f"\nSUMMARY reference vs SDK on CUDA [{label}, {ck.arch.parameter_count() / 1e6:.1f} M params, "
          f"{len(rows)} questions / {len(groups)} requests, {torch.cuda.get_device_name()}, torch {torch.__version__}]"
          f"\n  fp32 vs SDK fp32:                          {_fmt(fp32)}"
          f"\n  bf16, cuBLAS, SDK layout vs SDK bf16:      {_fmt(exact)}"
          f"\n  bf16, reference path vs SDK bf16:          {_fmt(bf16)}"
          f"\n  bf16, fast path (the default) vs SDK bf16: {_fmt(fast)}"
          f"\n  bf16, fast, LAYA_ATTN=sdpa vs SDK bf16:    {_fmt(sdpa)}"
          f"\n  noise: SDK bf16 one question per forward:  {_fmt(batching)}"
          f"\n  noise: SDK fp32 vs SDK bf16:               {_fmt(precision)}"
          f"\n  ({time.perf_counter() - t0:.1f} s)")
    assert fp32["agree"] >= AGREE_MIN and fp32["dp_max"] <= FP32_DP_MAX
    assert exact["agree"] >= AGREE_MIN and exact["dp_max"] <= DP_MAX
    assert bf16["agree_decisive"] >= AGREE_MIN
    assert bf16["agree"] >= min(AGREE_MIN, noise["agree"] - 0.01)
    assert bf16["dp_max"] <= max(DP_MAX, NOISE_FACTOR * noise["dp_max"])
    assert bf16["dp_mean"] <= max(DP_MAX / 10, NOISE_FACTOR * noise["dp_mean"])
    # The fast path, the workers' default, answers as the reference path does, with either attention: every op but
    # its GEMMs' order is the SDK's, as in the reference path.
    # One question of slack: a near tie may fall either way when a GEMM's order differs (both paths' GEMMs do).
    one = 1.0 / len(rows)
    for name, d in (("ours", fast), ("sdpa", sdpa)):
        assert d["agree_decisive"] >= AGREE_MIN and d["agree"] >= bf16["agree"] - one, (name, d)
        assert d["dp_max"] <= max(DP_MAX, 1.1 * bf16["dp_max"]), (name, d)
        assert d["dp_mean"] <= max(DP_MAX / 10, 1.1 * bf16["dp_mean"]), (name, d)
    # Our attention is cuDNN's order (kernels/attention.py): the same bits as SDPA's, question by question.
    differ = [i for i, (a, b) in enumerate(zip(ours16, sdpa16)) if not torch.equal(a, b)]
    assert not differ, f"{len(differ)} of {len(rows)} questions differ between our attention and SDPA: {differ[:10]}"


def test_parity_tiny(tiny_ckpt):
    _parity(tiny_ckpt, "tiny", n_requests=80, seed=11)


def test_parity_large(large_ckpt):
    _parity(large_ckpt, "large", n_requests=80, seed=12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_replays_new_inputs(tiny_ckpt, sdk_agent, dtype):
    ck = load_checkpoint(tiny_ckpt)
    ref = ReferenceModel(ck.arch, ck.tensors, device="cuda", dtype=dtype)
    groups = encode(sdk_agent, REQUESTS + make_requests(20, seed=5))
    rows = flat_rows(groups)
    T_CAP, R_CAP, K_CAP, L_CAP = 16384, 24, 24, 512

    def padded(part):
        inputs, slots = pack(part, device="cuda", extra_k=K_CAP - max(len(m) for _, m, _ in part),
                             extra_len=L_CAP, limit=L_CAP)
        n = inputs["row_start"].shape[0]
        assert n <= R_CAP and inputs["ids"].shape[0] <= T_CAP and inputs["max_row_len"] == L_CAP
        out = {"ids": torch.zeros(T_CAP, dtype=torch.int32, device="cuda"),
               "row_start": torch.zeros(R_CAP, dtype=torch.int32, device="cuda"),
               "row_len": torch.zeros(R_CAP, dtype=torch.int32, device="cuda"),
               "qtype": torch.zeros(R_CAP, dtype=torch.int32, device="cuda"),
               "markers": torch.full((R_CAP, K_CAP), -1, dtype=torch.int32, device="cuda")}
        out["ids"][:inputs["ids"].shape[0]] = inputs["ids"]
        for key in ("row_start", "row_len", "qtype", "markers"):
            out[key][:n] = inputs[key]
        return out, slots

    batches = [padded(rows[0:20]), padded(rows[20:30]), padded(rows[30:54])]
    static = {k: v.clone() for k, v in batches[0][0].items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            ref.forward(**static, max_row_len=L_CAP)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_logits, g_act = ref.forward(**static, max_row_len=L_CAP)

    worst = 0.0
    for inputs, slots in batches[1:] + batches[:1]:
        for k, v in inputs.items():
            static[k].copy_(v)
        graph.replay()
        e_logits, e_act = ref.forward(**inputs, max_row_len=L_CAP)
        torch.cuda.synchronize()
        assert torch.isfinite(g_logits).all() and torch.isfinite(g_act).all()
        worst = max(worst, float((g_logits - e_logits).abs().max()), float((g_act - e_act).abs().max()))
        n_real = len(slots)
        assert torch.all(g_logits[n_real:] == ABSENT_LOGIT)
    print(f"\nSUMMARY reference {str(dtype).removeprefix('torch.')} CUDA graph at T={T_CAP} R={R_CAP} K={K_CAP} "
          f"L={L_CAP}: {len(batches)} input sets replayed, max|graph - eager| {worst:.2e}")
    assert worst <= 1e-5
