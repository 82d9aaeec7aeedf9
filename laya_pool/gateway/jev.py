"""The Jev decision wire's two views of an answer, as `laya serve` 0.4.15 gives them.

- `x_jev_confidence` on every choice and score answer: the `confidence` TypeSafe Jev's own formula gives for the same
  probabilities (Laya's `confidence` is normalized entropy; a client porting a threshold from Jev reads this one):
      choice  (max(p) - 1/n) / (1 - 1/n)
      score   max(0, 1 - sum(p_i * |i - mode|) / D), D the same sum for a uniform distribution about the centre
  (each type's formula, field list and option order is its `served` part in protocol/qtypes.py).
  Both are 1.0 for one option; a zero total reads as uniform; a probability that is not a finite non-negative number
  (or is a bool) gives no field rather than a guess. Rounded to 4 decimals.
- the strict projection (`--jev-strict`): exactly Jev's contract, `model`, `answers` (each answer's discriminator and
  its type's fields) and `usage` (the two token counts); nothing recomputed, an answer of an unknown shape passed on.

Pure: tests/test_gateway_units.py holds both against the SDK's `laya.confidence.jev_confidence` and `laya.serve`.
"""
from __future__ import annotations

import math
from typing import Any

from laya_pool.protocol.qtypes import QUESTION_TYPES


def jev_confidence(answer: dict[str, Any]) -> float | None:
    """Jev's `confidence` for `answer`'s probabilities, or None (a type without one, or no usable numbers)."""
    qtype, probabilities = QUESTION_TYPES.find(answer.get("type")), answer.get("probabilities")
    if qtype is None or qtype.served.jev_order is None or not isinstance(probabilities, dict) or not probabilities:
        return None
    served = qtype.served
    try:
        p = [float(probabilities[k]) for k in served.jev_order(probabilities)]
    except (TypeError, ValueError):
        return None
    if any(isinstance(v, bool) for v in probabilities.values()) or not all(math.isfinite(v) and v >= 0 for v in p):
        return None
    n = len(p)
    if n == 1:
        return 1.0
    total = sum(p)
    p = [v / total for v in p] if total else [1.0 / n] * n
    return served.jev_confidence(p)


def add_jev_confidence(result: dict[str, Any]) -> dict[str, Any]:
    """`result` (copied, not edited) with `x_jev_confidence` on every answer that has a usable number."""
    if not isinstance(result.get("answers"), dict):
        return result
    answers: dict[str, Any] = {}
    for qid, answer in result["answers"].items():
        conf = jev_confidence(answer) if isinstance(answer, dict) else None
        answers[qid] = answer if conf is None else {**answer, "x_jev_confidence": round(conf, 4)}
    return {**result, "answers": answers}


def project_strict(result: dict[str, Any]) -> dict[str, Any]:
    """`result` reduced to the strict Jev contract: no `routing`, no per-answer `action` / `answer_confidence`, no
    `confidence` on a noul answer, `usage` with `input_tokens` and `output_tokens` only."""
    answers: dict[str, Any] = {}
    for qid, answer in (result.get("answers") or {}).items():
        qtype = QUESTION_TYPES.find(answer.get("type")) if isinstance(answer, dict) else None
        fields = qtype.served.strict_fields if qtype is not None else None
        answers[qid] = answer if fields is None else {f: answer[f] for f in fields}
    usage = result.get("usage") or {}
    return {"model": result["model"], "answers": answers,
            "usage": {"input_tokens": usage.get("input_tokens", 0), "output_tokens": usage.get("output_tokens", 0)}}
