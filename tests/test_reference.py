"""kernels.reference against the official SDK, fp32 on CPU, on the tiny checkpoint.

Rows are built by the SDK itself (question checks, normalisation, `_encode_state`, `collate_items`),
run through the SDK's own `DecisionModel` with forward hooks on every block, and through our
packed-row `ReferenceModel`; every intermediate is compared on real tokens. The helpers here are
shared with tests/test_reference_gpu.py.
"""
from __future__ import annotations

import json
import random
import time

import pytest
import torch

from laya_pool.kernels.reference import ABSENT_LOGIT, ReferenceModel
from laya_pool.worker.checkpoint import load_checkpoint

TAP_NRMS = 1e-5
LOGIT_TOL = 1e-4
ACT_TOL = 1e-5

LONG = ("The payment page keeps failing after the last deploy and the customer was charged twice for "
        "the same order; they want a refund today and threaten to cancel the subscription. ")

# ≥13 hand-picked requests: short and long states (the tiny window is 16 tokens), every question
# type, many options, several questions per request, unicode, JSON and conversation states.
REQUESTS: list[tuple[object, dict]] = [
    ("hi", {"urgent": {"type": "noul", "instructions": "Is this urgent?"}}),
    ("My card was declined twice and I need a refund today", {
        "team": {"type": "choice", "instructions": "Which team handles this ticket?",
                 "criteria": {"billing": "money issues", "tech": "bugs and crashes", "sales": "", "legal": None}},
        "urgent": {"type": "noul", "instructions": "Is this urgent?"},
        "sev": {"type": "score", "instructions": "How severe?", "criteria": ["none", "minor", "major", "critical"]},
    }),
    (LONG * 3, {"sev": {"type": "score", "instructions": "Rate the severity of the incident",
                        "criteria": [f"level {i} impact" for i in range(10)]}}),
    (LONG * 40, {   # far past max_len: the state is clamped by build_sequence
        "team": {"type": "choice", "instructions": "Route it", "criteria": ["billing", "tech", "sales"]},
        "refund": {"type": "noul", "instructions": "Does the customer ask for money back?",
                   "criteria": {"true": "asks for a refund", "false": "no refund requested"}},
    }),
    ({"subject": "Server down", "priority": "high", "body": "database timeout after rollback", "id": 42}, {
        "team": {"type": "choice", "instructions": "Which team?",
                 "criteria": {f"team_{i}": f"handles area {i} of the product" for i in range(14)}},
    }),
    ([{"role": "user", "content": "hello, my package was lost"},
      {"role": "assistant", "content": "sorry to hear that, can you share the order id?"},
      {"role": "user", "content": "order 12345, it was damaged too " * 30}], {   # list: truncated from the left
        "intent": {"type": "choice", "instructions": "What does the user want now?",
                   "criteria": {"return": "send it back", "exchange": "a new one", "refund": "money back"}},
        "angry": {"type": "noul", "instructions": "Is the user angry?"},
    }),
    ("Grüße aus Zürich — die Rückerstattung über €100 fehlt noch. 東京 注文 返金 緊急 🙂 ✅ Привет заказ возврат", {
        "urgent": {"type": "noul", "instructions": "Ist das dringend? 緊急?"},
        "lang": {"type": "choice", "instructions": "Which language dominates?",
                 "criteria": ["German", "Japanese", "Russian", "Arabic", "English"]},
    }),
    ("Please reset my password [MASK] and close the ticket [MASK] thanks", {
        "action": {"type": "choice", "instructions": "Next [MASK] step?",
                   "criteria": {"reset": "reset the password", "close": "close the ticket", "escalate": 3}},
    }),
    ("a", {"q1": {"type": "noul", "instructions": "x"},
           "q2": {"type": "score", "instructions": "y", "criteria": ["low", "high"]},
           "q3": {"type": "choice", "instructions": "z", "criteria": ["a", "b"]},
           "q4": {"type": "noul", "instructions": "w", "labels": {"false": "nope", "true": "yep"}}}),
    (LONG * 6, {"prio": {"type": "score", "instructions": {"task": "priority", "scale": "0-3"},
                         "criteria": [{"desc": "ignore"}, "low", "medium", "high"]},
                "team": {"type": "choice", "instructions": "Route",
                         "criteria": {f"option number {i} with a long description " * 2: None for i in range(20)}}}),
    ({"events": [{"t": i, "msg": f"latency spike on node {i}"} for i in range(25)], "ok": False}, {
        "outage": {"type": "noul", "instructions": "Is there an outage?"},
        "sev": {"type": "score", "instructions": "Severity", "criteria": ["none", "minor", "major"]},
    }),
    ("thanks, all good now " * 5, {"close": {"type": "noul", "instructions": "Can we close the ticket?",
                                            "criteria": {"true": "", "false": None}}}),
    ("مرحبا طلب 🙂 " * 12 + "¥500 jalapeño café résumé façade naïve", {
        "team": {"type": "choice", "instructions": "Which team?",
                 "criteria": ["billing", "tech", "sales", "legal", "security", "privacy", "support"]},
        "urgent": {"type": "noul", "instructions": "Urgent?"},
        "sev": {"type": "score", "instructions": "Severity", "criteria": [str(i) for i in range(7)]},
    }),
    ("", {"empty": {"type": "choice", "instructions": "Anything?", "criteria": ["yes", "no"]}}),
]

_WORDS = ("ticket customer refund invoice urgent billing account password reset login error crash payment card "
          "declined shipping delayed order package lost damaged return exchange warranty support outage server "
          "database latency timeout deploy rollback the a is of to in for with please thanks").split()
_UNI = "Grüße Straße café 東京 注文 返金 緊急 Привет заказ مرحبا 🙂 ✅ €100".split()


def make_requests(n: int, seed: int = 0) -> list[tuple[object, dict]]:
    """`n` seeded, varied requests (state kinds, lengths, question types, option counts)."""
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(_WORDS if rng.random() > 0.1 else _UNI) for _ in range(rng.randint(lo, hi)))

    out = []
    for i in range(n):
        kind = i % 4
        size = rng.choice([(1, 4), (5, 30), (30, 120), (120, 600)])
        if kind == 0:
            state: object = text(*size)
        elif kind == 1:
            state = {"subject": text(2, 8), "body": text(*size), "priority": rng.choice(["low", "high"]), "id": i}
        elif kind == 2:
            state = [{"role": rng.choice(["user", "assistant"]), "content": text(*size)} for _ in range(3)]
        else:
            state = json.dumps({"log": [text(3, 12) for _ in range(rng.randint(1, 20))]}, ensure_ascii=False)
        qs: dict = {}
        for j in range(rng.randint(1, 5)):
            t = rng.choice(["choice", "score", "noul"])
            if t == "choice":
                qs[f"c{j}"] = {"type": t, "instructions": text(2, 10),
                               "criteria": {f"opt{k}": (text(1, 6) if rng.random() > 0.3 else None)
                                            for k in range(rng.randint(2, 16))}}
            elif t == "score":
                qs[f"s{j}"] = {"type": t, "instructions": text(2, 10),
                               "criteria": [text(1, 4) for _ in range(rng.randint(2, 10))]}
            else:
                qs[f"n{j}"] = {"type": t, "instructions": text(2, 12)}
        out.append((state, qs))
    return out


def encode(agent, requests) -> list[list[dict]]:
    """The SDK's own rows: one group of items (ids, markers, qtype) per request."""
    groups = []
    for state, questions in requests:
        ids = list(questions)
        for qid in ids:
            agent._check_question(qid, questions[qid])
        internal = {qid: agent._to_internal(questions[qid]) for qid in ids}
        groups.append(agent._encode_state(state, ids, internal))
    return groups


def pack(rows, device="cpu", order=None, gap=0, pad_rows=(), extra_k=0, extra_len=0, extra_t=0, limit=512):
    """Pack `rows` [(ids, markers, qtype)] into ReferenceModel inputs.

    `order` is the slot order of the rows in the packed token buffer, `gap` tokens of junk are left
    between rows, `pad_rows` are slot indices that hold zero-length padding rows, and `extra_*` widen
    K_cap / max_row_len / T_cap past what the rows need (max_row_len at most `limit`). Returns
    (inputs dict, slot of each row).
    """
    n = len(rows)
    order = list(range(n)) if order is None else list(order)
    n_slots = n + len(pad_rows)
    real_slots = [s for s in range(n_slots) if s not in set(pad_rows)]
    slot_of = [0] * n
    for pos, r in enumerate(order):
        slot_of[r] = real_slots[pos]
    k_cap = max(len(m) for _, m, _ in rows) + extra_k
    max_len = min(max(len(i) for i, _, _ in rows) + extra_len, max(limit, max(len(i) for i, _, _ in rows)))
    buf: list[int] = []
    row_start = [0] * n_slots
    row_len = [0] * n_slots
    qtype = [0] * n_slots
    markers = torch.full((n_slots, k_cap), -1, dtype=torch.int32)
    for r in order:
        ids, mk, qt = rows[r]
        s = slot_of[r]
        buf += [7] * gap
        row_start[s], row_len[s], qtype[s] = len(buf), len(ids), qt
        buf += list(ids)
        markers[s, :len(mk)] = torch.tensor(mk, dtype=torch.int32)
    for s in pad_rows:
        row_start[s] = len(buf)        # points at junk / the end: must be ignored
        qtype[s] = 1
    buf += [5] * (gap + extra_t + 1)
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    inputs = dict(ids=t(buf), row_start=t(row_start), row_len=t(row_len), qtype=t(qtype),
                  markers=markers.to(device), max_row_len=max_len)
    return inputs, slot_of


def flat_rows(groups) -> list[tuple[list[int], list[int], int]]:
    return [(it["ids"], it["markers"], it["qtype"]) for g in groups for it in g]


def sdk_forward(agent, groups, taps: bool):
    """The SDK model on the collated batch: (logits, act_probs, hidden states by tap name)."""
    from laya.common import collate_items

    b = collate_items(groups, agent.tok.pad_token_id)
    model = agent.model
    states: dict[str, torch.Tensor] = {}
    handles = []
    if taps:
        def hook(name):
            def save(_module, _inputs, output):
                states[name] = (output[0] if isinstance(output, tuple) else output).detach().float().cpu()
            return save
        handles.append(model.encoder.embeddings.register_forward_hook(hook("embeddings")))
        for i, layer in enumerate(model.encoder.layers):
            handles.append(layer.register_forward_hook(hook(f"encoder.{i}")))
        handles.append(model.encoder.final_norm.register_forward_hook(hook("final_norm")))
        for j, layer in enumerate(model.head.layers):
            handles.append(layer.register_forward_hook(hook(f"head.{j}")))
    try:
        with torch.no_grad():
            dev = next(model.parameters()).device
            logits, act = model(*(b[k].to(dev) for k in ("input_ids", "attention_mask", "marker_pos",
                                                         "marker_mask", "qtype")))
    finally:
        for h in handles:
            h.remove()
    return logits.float().cpu(), torch.softmax(act.float(), -1).cpu(), states


def nrms(ours: torch.Tensor, ref: torch.Tensor, lens, slot_of) -> float:
    """sqrt(sum Δ² / sum ref²) over the real tokens of every row (ours padded by slot, ref by row)."""
    num = den = 0.0
    for r, n in enumerate(lens):
        a, b = ours[slot_of[r], :n].double().cpu(), ref[r, :n].double()
        num += float(((a - b) ** 2).sum())
        den += float((b ** 2).sum())
    return (num / den) ** 0.5


def run_ref(model: ReferenceModel, inputs: dict, taps: bool = False):
    t: dict | None = {} if taps else None
    logits, act = model.forward(**inputs, taps=t)
    return logits, act, t


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return load_checkpoint(tiny_ckpt)


@pytest.fixture(scope="module")
def ref(ckpt):
    return ReferenceModel(ckpt.arch, ckpt.tensors)


@pytest.fixture(scope="module")
def case(sdk_agent):
    groups = encode(sdk_agent, REQUESTS)
    rows = flat_rows(groups)
    logits, act, states = sdk_forward(sdk_agent, groups, taps=True)
    return {"groups": groups, "rows": rows, "logits": logits, "act": act, "states": states}


def _compare(ref_model, case, inputs, slot_of):
    logits, act, taps = run_ref(ref_model, inputs, taps=True)
    rows = case["rows"]
    lens = [len(i) for i, _, _ in rows]
    tap_err = {name: nrms(taps[name], hs, lens, slot_of) for name, hs in case["states"].items()}
    dl = max(float((logits[slot_of[r], :len(mk)] - case["logits"][r, :len(mk)]).abs().max())
             for r, (_, mk, _) in enumerate(rows))
    da = max(float((act[slot_of[r]] - case["act"][r]).abs().max()) for r in range(len(rows)))
    return tap_err, dl, da, logits, act


# --------------------------------------------------------------------------- tests


def test_request_set_is_varied(case, ckpt):
    rows = case["rows"]
    lens = [len(i) for i, _, _ in rows]
    assert len(REQUESTS) >= 13 and len(rows) >= 25
    assert {q for _, _, q in rows} == {0, 1, 2}
    assert max(len(m) for _, m, _ in rows) >= 14
    assert max(lens) == ckpt.arch.max_len and min(lens) < 64
    assert sum(n > 4 * ckpt.arch.local_window for n in lens) >= 10
    # the SDK's answers are not degenerate on this set (or parity would prove nothing)
    p = torch.softmax(case["logits"], -1)
    assert float((p.max(-1).values - p.topk(2, -1).values[:, 1]).max()) > 0.1


def test_every_tap_matches_the_sdk(ref, case):
    t0 = time.perf_counter()
    inputs, slot_of = pack(case["rows"])
    tap_err, dl, da, logits, _ = _compare(ref, case, inputs, slot_of)
    worst = max(tap_err, key=tap_err.get)
    print(f"\nreference vs SDK fp32 CPU: {len(case['rows'])} rows, worst tap nRMS {tap_err[worst]:.2e} ({worst}), "
          f"logits max|d| {dl:.2e}, act max|d| {da:.2e} ({time.perf_counter() - t0:.2f}s)")
    assert set(tap_err) == {"embeddings", "final_norm"} | {f"encoder.{i}" for i in range(ref.arch.layers)} \
        | {f"head.{j}" for j in range(ref.arch.head_layers)}
    for name, err in tap_err.items():
        assert err <= TAP_NRMS, (name, err)
    assert dl <= LOGIT_TOL
    assert da <= ACT_TOL
    for r, (_, mk, _) in enumerate(case["rows"]):
        assert torch.all(logits[slot_of[r], len(mk):] == ABSENT_LOGIT)


def test_bf16_on_the_sdks_kernels_is_bit_exact(ckpt, sdk_agent, case):
    """bf16 with torch's own GEMMs (`gemm="vendor"`), one forward per request as the SDK collates it:
    every tap and logit equals the SDK's under bf16 autocast bit for bit, which pins down the op order
    (fp32 residual stream and norms, RoPE tables, where the head rounds before its biases).

    On the CPU torch runs the SDK's head through its fused "fast path" under autocast (CUDA autocast
    turns that path off), so it is turned off here to compare the same operations the GPU runs."""
    model = ReferenceModel(ckpt.arch, ckpt.tensors, dtype=torch.bfloat16, gemm="vendor")
    held = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        for gi, g in enumerate(case["groups"]):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                sdk_logits, _, states = sdk_forward(sdk_agent, [g], taps=True)
            part = flat_rows([g])
            inputs, slot_of = pack(part)
            logits, _, taps = run_ref(model, inputs, taps=True)
            lens = [len(i) for i, _, _ in part]
            for name, want in states.items():
                assert nrms(taps[name].float(), want, lens, slot_of) == 0.0, (gi, name)
            for r, (_, mk, _) in enumerate(part):
                assert torch.equal(logits[slot_of[r], :len(mk)].float(), sdk_logits[r, :len(mk)]), (gi, r)
    finally:
        torch.backends.mha.set_fastpath_enabled(held)


@pytest.mark.parametrize("short_only", [False, True])
def test_padding_rows_and_extra_columns_do_not_change_real_rows(ref, case, short_only):
    rows = [r for r in case["rows"] if not short_only or len(r[0]) <= 400]
    plain, slots = pack(rows)
    l0, a0, _ = run_ref(ref, plain)
    n = len(rows)
    pad_rows = (0, 5, n // 2 + 3, n + 2)
    padded, pslots = pack(rows, pad_rows=pad_rows, extra_k=5, extra_len=29, extra_t=100)
    assert padded["markers"].shape == (n + len(pad_rows), plain["markers"].shape[1] + 5)
    assert padded["max_row_len"] > plain["max_row_len"] or not short_only
    l1, a1, taps = run_ref(ref, padded, taps=True)
    for r, (_, mk, _) in enumerate(rows):
        k = len(mk)
        assert torch.allclose(l1[pslots[r], :k], l0[slots[r], :k], atol=1e-5, rtol=0), r
        assert torch.allclose(a1[pslots[r]], a0[slots[r]], atol=1e-6, rtol=0), r
        assert torch.all(l1[pslots[r], k:] == ABSENT_LOGIT)
    for s in pad_rows:
        assert torch.isfinite(l1[s]).all() and torch.isfinite(a1[s]).all()
    for name, v in taps.items():
        assert torch.isfinite(v).all(), name


def test_zero_length_rows_give_finite_outputs(ref):
    # Only padding rows, and padding rows whose row_start points past the buffer.
    ids = torch.tensor([1, 2, 3], dtype=torch.int32)
    z = torch.zeros(3, dtype=torch.int32)
    taps: dict = {}
    logits, act = ref.forward(ids, torch.tensor([0, 2, 50], dtype=torch.int32), z, z,
                              torch.full((3, 4), -1, dtype=torch.int32), 24, taps=taps)
    assert logits.shape == (3, 4) and act.shape == (3, ref.arch.n_act)
    assert torch.all(logits == ABSENT_LOGIT)
    assert torch.isfinite(act).all()
    assert all(torch.isfinite(v).all() for v in taps.values())


def test_packing_order_does_not_change_outputs(ref, case):
    rows = case["rows"]
    l0, a0, _ = run_ref(ref, pack(rows)[0])
    order = list(reversed(range(len(rows))))
    random.Random(3).shuffle(order)
    inputs, slots = pack(rows, order=order, gap=11, pad_rows=(1, 4), extra_len=3)
    l1, a1, _ = run_ref(ref, inputs)
    for r, (_, mk, _) in enumerate(rows):
        assert torch.allclose(l1[slots[r], :len(mk)], l0[r, :len(mk)], atol=1e-5, rtol=0), r
        assert torch.allclose(a1[slots[r]], a0[r], atol=1e-6, rtol=0), r


def test_int64_inputs_and_call(ref, case):
    rows = case["rows"][:5]
    inputs, _ = pack(rows)
    l0, a0, _ = run_ref(ref, inputs)
    wide = {k: (v.long() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    l1, a1 = ref(**wide)
    assert torch.equal(l0, l1) and torch.equal(a0, a1)
    assert l1.dtype == torch.float32 and a1.dtype == torch.float32


def test_single_option_question_matches_sdk(sdk_agent, ref):
    req = [("just one option here " * 3, {"only": {"type": "choice", "instructions": "Pick", "criteria": ["solo"]}})]
    groups = encode(sdk_agent, req)
    rows = flat_rows(groups)
    assert [len(m) for _, m, _ in rows] == [1]
    logits, act, _ = sdk_forward(sdk_agent, groups, taps=False)
    inputs, slots = pack(rows)
    assert inputs["markers"].shape[1] == 1          # K_cap == 1: top2 is 0, as in the SDK
    ours_l, ours_a, _ = run_ref(ref, inputs)
    assert float((ours_l[0] - logits[0]).abs().max()) <= LOGIT_TOL
    assert float((ours_a[0] - act[0]).abs().max()) <= ACT_TOL


def test_harness_catches_a_perturbed_weight(ckpt, case):
    tensors = dict(ckpt.tensors)
    name = "encoder.layers.1.mlp.Wo.weight"
    # Random signs: a constant shift of every entry would be invisible to the next LayerNorm.
    noise = torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(0))
    tensors[name] = tensors[name] + 1e-2 * noise
    bad = ReferenceModel(ckpt.arch, tensors)
    inputs, slot_of = pack(case["rows"])
    tap_err, dl, _, _, _ = _compare(bad, case, inputs, slot_of)
    print(f"\nperturbed {name}: nRMS embeddings {tap_err['embeddings']:.1e}, encoder.0 {tap_err['encoder.0']:.1e}, "
          f"encoder.1 {tap_err['encoder.1']:.1e}, logits max|d| {dl:.1e}")
    assert tap_err["embeddings"] <= TAP_NRMS and tap_err["encoder.0"] <= TAP_NRMS
    assert tap_err["encoder.1"] > TAP_NRMS * 10, tap_err["encoder.1"]
    assert dl > LOGIT_TOL


def test_rejects_bad_arguments(ckpt):
    with pytest.raises(ValueError):
        ReferenceModel(ckpt.arch, ckpt.tensors, dtype=torch.int32)
    with pytest.raises(ValueError, match="gemm"):
        ReferenceModel(ckpt.arch, ckpt.tensors, gemm="fast")
    with pytest.raises(KeyError):
        ReferenceModel(ckpt.arch, {k: v for k, v in ckpt.tensors.items() if k != "scorer.1.bias"})
    m = ReferenceModel(ckpt.arch, ckpt.tensors)
    z = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError):
        m.forward(z, z, z, z, torch.full((1, 2), -1, dtype=torch.int32), ckpt.arch.max_len + 1)
