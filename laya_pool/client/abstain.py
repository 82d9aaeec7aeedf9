"""`min_confidence`: the SDK's opt-in abstention gate, on answer dicts (no I/O, no model).

The rules are the SDK's (laya 0.4.15 `laya.confidence`: `check_min_confidence`, `flag_low_confidence`,
`apply_confidence_gate`), held to it by tests/test_client_sdk_api.py:

- `min_confidence` is a float in [0, 1] (a bool is refused) or a map from option-count bucket
  ("choice:3-5", "noul:2", ...; `protocol.qtypes.option_bucket`) plus "default" to a float;
- the gate reads `answer_confidence` (max(p)), falling back to the entropy `confidence`;
- with a threshold, every answer gets `abstention` ("passed", "abstained" or "unevaluated") and
  `abstention_threshold`, and `low_confidence: True` when it fell below; without one nothing is written.
"""
from __future__ import annotations

import math
from typing import Any

from laya_pool.protocol.qtypes import QUESTION_TYPES, option_bucket

GATE_PASSED = "passed"
GATE_ABSTAINED = "abstained"
GATE_UNEVALUATED = "unevaluated"

_DEFAULT = "default"


def bucket_keys() -> set[str]:
    """Every bucket a `min_confidence` map may name."""
    return QUESTION_TYPES.buckets()


def _check_one(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0.0 or v > 1.0:
        raise ValueError(f"min_confidence must be a float in [0.0, 1.0], got {v!r}")
    return float(v)


def check_min_confidence(v: Any) -> float | dict[str, float]:
    """The threshold in its validated form: a float, or a map of bucket -> float. ValueError otherwise."""
    if not isinstance(v, dict):
        return _check_one(v)
    if not v:
        raise ValueError(f"a min_confidence map must be a non-empty dict of bucket -> float, got {v!r}")
    allowed = bucket_keys() | {_DEFAULT}
    out: dict[str, float] = {}
    for key, val in v.items():
        # A key no answer can produce would leave a bucket ungated while the caller believes it is gated.
        if not isinstance(key, str) or key not in allowed:
            raise ValueError(f"min_confidence map keys must be a bucket like 'choice:3-5' or 'default', got {key!r}")
        out[key] = _check_one(val)
    return out


def answer_confidence_value(answer: dict[str, Any]) -> float | None:
    """`answer_confidence` when it is a usable number (not a bool, finite), else None."""
    conf = answer.get("answer_confidence")
    if isinstance(conf, (int, float)) and not isinstance(conf, bool) and math.isfinite(conf):
        return float(conf)
    return None


def _gate_confidence(answer: dict[str, Any]) -> float | None:
    conf = answer_confidence_value(answer)
    if conf is not None:
        return conf
    fallback = answer.get("confidence")
    if isinstance(fallback, (int, float)) and not isinstance(fallback, bool) and math.isfinite(fallback):
        return float(fallback)
    return None


def _bucket(answer: dict[str, Any]) -> str | None:
    qtype = QUESTION_TYPES.find(answer.get("type"))
    if qtype is None:
        return None
    probs = answer.get("probabilities")
    if isinstance(probs, dict) and probs:
        k = len(probs)
    elif qtype.fixed_options is not None:     # noul's answer carries P(true), not its two probabilities
        k = qtype.fixed_options
    else:
        return None
    return option_bucket(qtype.name, k)


def threshold_for(answer: dict[str, Any], min_confidence: float | dict[str, float]) -> float:
    """The threshold this answer is gated at: the float, or its bucket's entry, "default", then 0.0."""
    if not isinstance(min_confidence, dict):
        return float(min_confidence)
    key = _bucket(answer)
    if key is not None and key in min_confidence:
        return min_confidence[key]
    return min_confidence.get(_DEFAULT, 0.0)


def _answers(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for res in results:
        answers = res.get("answers") if isinstance(res, dict) else None
        if isinstance(answers, dict):
            out.extend(a for a in answers.values() if isinstance(a, dict))
    return out


def apply_confidence_gate(results: list[dict[str, Any]], min_confidence: float | dict[str, float] | None) -> None:
    """Mark every answer of `results` in place (see the module docstring); a no-op when `min_confidence` is None."""
    if min_confidence is None:
        return
    for a in _answers(results):
        conf = _gate_confidence(a)
        # The flag is also cleared, so a reused payload gated again at a laxer threshold reads right.
        if conf is not None and conf < threshold_for(a, min_confidence):
            a["low_confidence"] = True
        else:
            a.pop("low_confidence", None)
    for a in _answers(results):
        if a.get("low_confidence"):
            a["abstention"] = GATE_ABSTAINED
        elif _gate_confidence(a) is None:
            a["abstention"] = GATE_UNEVALUATED
        else:
            a["abstention"] = GATE_PASSED
        a["abstention_threshold"] = float(threshold_for(a, min_confidence))
