"""The model's per-marker logits and act probabilities back into the SDK's answer dicts.

`decode_answers` returns what `laya.Agent.predict(state, questions)` returns for the same model
outputs, value for value: the same float32 numpy arithmetic in the same order (so probabilities
agree to the bit before rounding), the same temperature buckets, the same rounding to 4 decimals and
the same `usage` block (laya 0.4.15 `Agent._decode_answers` and `predict_batch`).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from client.card import ModelCard
from client.semantics import EncodedRequest, render_criterion
from protocol.contract import QType

MODEL_NAME = "laya-rl-agent"


def temp_bucket(qtype: int, k: int) -> str:
    """The `temperature_by_options` key for a question type and option count, e.g. "choice:3-5"."""
    size = "2" if k <= 2 else "3-5" if k <= 5 else "6-10" if k <= 10 else "11+"
    return f"{QType(int(qtype)).name.lower()}:{size}"


def temperature_for(card: ModelCard, qtype: int, k: int) -> float:
    return card.temperature_by_options.get(temp_bucket(qtype, k), card.temperature[qtype])


def softmax_f32(raw: np.ndarray, t: float) -> np.ndarray:
    """The SDK's tempered softmax, op for op in float32 (the order of operations fixes the last bits)."""
    z = raw / t
    p = np.exp(z - z.max())
    p /= p.sum()
    return p


def unpermute(p: np.ndarray, option_order: list[int] | None) -> np.ndarray:
    """Slot order (what the model saw) back to option order (what the caller wrote)."""
    if option_order is None or len(option_order) != len(p):
        return p
    out = np.empty_like(p)
    out[np.asarray(option_order, dtype=int)] = p
    return out


def answer_confidence(p: np.ndarray, k: int) -> float:
    """max(p): the calibrated number, the one temperature scaling fits."""
    if k < 1:
        return 1.0
    val = float(p[:k].max())
    return 0.0 if val < 0.0 else (1.0 if val > 1.0 else val)


def entropy_confidence(p: np.ndarray, k: int) -> float:
    """1 - H(p)/log(k), the SDK's `confidence` for choice and score (not calibrated)."""
    if k < 2:
        return 1.0
    pk = p[:k]
    ent = -float((pk * np.log(np.clip(pk, 1e-12, 1.0))).sum())
    score = 1.0 - ent / math.log(k)
    return 0.0 if score < 0.0 else (1.0 if score > 1.0 else score)


def _answer(q: dict[str, Any], p: np.ndarray, k: int, act_row: np.ndarray) -> dict[str, Any]:
    action = {"act_probability": round(float(act_row[0]), 4)}
    ans_conf = round(answer_confidence(p, k), 4)
    if q["t"] == "choice":
        keys = list(q["crit"].keys())
        return {
            "type": "choice",
            "choice": keys[int(p.argmax())],     # the caller's own label, type and all
            "probabilities": {key: round(float(v), 4) for key, v in zip(keys, p)},
            "confidence": round(entropy_confidence(p, k), 4),
            "answer_confidence": ans_conf,
            "action": action,
        }
    if q["t"] == "score":
        return {
            "type": "score",
            "score": round(float((np.arange(k) * p).sum()), 4),
            "legend": {str(i): render_criterion(c) for i, c in enumerate(q["crit"])},
            "probabilities": {str(i): round(float(v), 4) for i, v in enumerate(p)},
            "confidence": round(entropy_confidence(p, k), 4),
            "answer_confidence": ans_conf,
            "action": action,
        }
    p_true = float(p[1])
    return {
        "type": "noul",
        "noul": round(p_true, 4),
        "confidence": round(max(p_true, 1.0 - p_true), 4),
        "answer_confidence": ans_conf,
        "action": action,
    }


def _usage(encoded: EncodedRequest) -> dict[str, Any]:
    stats = encoded.state_stats
    # The questions share one state but not one head budget: report the worst cut.
    dropped = max(s["state_tokens_dropped"] for s in stats)
    usage: dict[str, Any] = {
        "input_tokens": encoded.n_tokens,
        "output_tokens": 0,
        "state_tokens": stats[0]["state_tokens"],
        "state_tokens_dropped": dropped,
        "truncated": dropped > 0,
        "truncated_questions": [qid for qid, s in zip(encoded.qids, stats) if s["truncated"]],
    }
    # Present only when some question's options lost their distinct token spans to the head budget.
    collapsed = {
        qid: {"total": o["options"], "distinct": o["options_distinct"], "tokens_per_option": o["tokens_per_option"]}
        for qid, o in zip(encoded.qids, encoded.option_stats) if o["options_distinct"] < o["options"]
    }
    if collapsed:
        usage["options"] = collapsed
    return usage


def decode_answers(card: ModelCard, encoded: EncodedRequest, logits: Any, act_probs: Any) -> dict[str, Any]:
    """The SDK `predict()` result for `encoded` given the model's outputs.

    `logits` is float32 [M]: every row's per-marker logits back to back, rows in order (M = the
    request's marker count); `act_probs` is float32 [R, n_act], the softmax of the act head.
    """
    if not encoded.rows:
        return {"model": MODEL_NAME, "answers": {}, "usage": {"input_tokens": 0, "output_tokens": 0}}
    flat = np.asarray(logits, dtype=np.float32).reshape(-1)
    act = np.asarray(act_probs, dtype=np.float32)
    if flat.shape[0] != encoded.n_markers:
        raise ValueError(f"decode_answers: got {flat.shape[0]} logits for a request with {encoded.n_markers} "
                         "option markers")
    if act.ndim != 2 or act.shape[0] != len(encoded.rows) or act.shape[1] < 1:
        raise ValueError(f"decode_answers: act_probs must be [{len(encoded.rows)}, n_act], got {list(act.shape)}")
    answers: dict[Any, Any] = {}
    offset = 0
    for r, (qid, q, (_, markers, qtype)) in enumerate(zip(encoded.qids, encoded.questions, encoded.rows)):
        k = len(markers)
        # A copy keeps every row its own contiguous array, as the SDK's row slice is.
        raw = flat[offset:offset + k].copy()
        offset += k
        p = softmax_f32(raw, temperature_for(card, qtype, k))
        p = unpermute(p, q.get("option_order"))
        answers[qid] = _answer(q, p, k, act[r])
    return {"model": MODEL_NAME, "answers": answers, "usage": _usage(encoded)}
