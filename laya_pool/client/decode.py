"""The model's per-marker logits and act probabilities back into the SDK's answer dicts.

`decode_answers` returns what `laya.Agent.predict(state, questions)` returns for the same model
outputs, value for value: the same float32 numpy arithmetic in the same order (so probabilities
agree to the bit before rounding), the same temperature buckets, the same rounding to 4 decimals and
the same `usage` block (laya 0.4.15 `Agent._decode_answers` and `predict_batch`).
"""
from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np

from laya_pool.protocol.qtypes import QUESTION_TYPES, option_bucket

from .calibration import Calibration, apply_binning
from .card import TEMP_MAX, TEMP_MIN, ModelCard, clamp_temperature, temperature_rejected
from .semantics import EncodedRequest

MODEL_NAME = "laya-rl-agent"


@functools.lru_cache(maxsize=256)      # a few question types x option counts; every answer asks
def temp_bucket(qtype: int, k: int) -> str:
    """The `temperature_by_options` key for a question type and option count, e.g. "choice:3-5"."""
    return option_bucket(QUESTION_TYPES.by_id(qtype).name, k)


LangTemperatures = dict[str, dict[str, Any]]


def lang_override(lang: str | None, lang_temperatures: LangTemperatures | None) -> dict[str, Any] | None:
    """The temperatures `lang` ("de", "de-AT") has an override for, or None."""
    if lang and lang_temperatures:
        return lang_temperatures.get(lang.split("-")[0].lower())
    return None


def temperature_for(card: ModelCard, qtype: int, k: int, lang: str | None = None,
                    lang_temperatures: LangTemperatures | None = None, calibration: Calibration | None = None) -> float:
    """The temperature of a question: its language's (when `lang` has an override), else the calibration
    file's (when there is one), else the card's."""
    bucket = temp_bucket(qtype, k)
    source: Any = lang_override(lang, lang_temperatures)
    if source is not None:
        return source["temperature_by_options"].get(bucket, source["temperature"][qtype])
    source = calibration or card
    return source.temperature_by_options.get(bucket, source.temperature[qtype])


def resolve_lang_temperatures(raw: dict[str, Any] | None, base: Any) -> LangTemperatures:
    """The SDK's `lang_temperatures` load option (`laya.load(..., lang_temperatures=...)`) as
    {language: {"temperature": [a float per question type], "temperature_by_options": {bucket: float}}}: keys cut to the
    language ("de-AT" -> "de"), a missing temperature inherits `base` (the card's raw list), every value
    clamped as the SDK clamps it (with its warning). ValueError names a malformed entry."""
    resolved: LangTemperatures = {}
    for lang, cfg in (raw or {}).items():
        if not isinstance(lang, str):
            raise ValueError(f"Language override keys must be strings, got {lang!r}")
        if cfg is None:
            cfg = {}
        if not isinstance(cfg, dict):
            raise ValueError(f"Language override {lang!r} must be a mapping, got {type(cfg).__name__}")
        t_raw = cfg.get("temperature")
        inherited = t_raw is None
        if inherited:
            t_raw = base
        if not isinstance(t_raw, (list, tuple)) or len(t_raw) != len(QUESTION_TYPES):
            raise ValueError(f"Language override {lang!r} temperature must be a list of {len(QUESTION_TYPES)} floats, "
                             f"got {t_raw!r}")
        tbo_raw = cfg.get("temperature_by_options") or {}
        if not isinstance(tbo_raw, dict):
            raise ValueError(f"Language override {lang!r} temperature_by_options must be a mapping of "
                             f"bucket -> float, got {type(tbo_raw).__name__}")
        temperature = [clamp_temperature(t) for t in t_raw]
        by_options = {k: clamp_temperature(v) for k, v in tbo_raw.items()}
        entries = [] if inherited else [(f"temperature[{i}]", r, a) for i, (r, a) in enumerate(zip(t_raw, temperature))]
        entries += [(str(k), v, by_options[k]) for k, v in tbo_raw.items()]
        rejected = [f"{name}={r!r} -> {a:g}" for name, r, a in entries if temperature_rejected(r, a)]
        if rejected:
            warnings.warn(f"laya: language override {lang!r} ships invalid temperatures or values outside "
                          f"[{TEMP_MIN:g}, {TEMP_MAX:g}]; using {', '.join(rejected)}. Treat confidence from the "
                          "affected entries as uncalibrated.", RuntimeWarning, stacklevel=2)
        resolved[lang.split("-")[0].lower()] = {"temperature": temperature, "temperature_by_options": by_options}
    return resolved


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


def _answer(q: dict[str, Any], p: np.ndarray, k: int, act_row: np.ndarray,
            binning: tuple[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    action = {"act_probability": round(float(act_row[0]), 4)}
    ans_conf = answer_confidence(p, k)
    if binning is not None:             # (bucket, map): a calibration file's recalibration of it
        ans_conf = apply_binning(ans_conf, *binning)
    answer = QUESTION_TYPES.by_name(q["t"]).answer(q, p, k)
    answer["answer_confidence"] = round(ans_conf, 4)
    answer["action"] = action
    return answer


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


def decode_answers(card: ModelCard, encoded: EncodedRequest, logits: Any, act_probs: Any, lang: str | None = None,
                   lang_temperatures: LangTemperatures | None = None,
                   calibration: Calibration | None = None) -> dict[str, Any]:
    """The SDK `predict()` result for `encoded` given the model's outputs.

    `logits` is float32 [M]: every row's per-marker logits back to back, rows in order (M = the
    request's marker count); `act_probs` is float32 [R, n_act], the softmax of the act head. `lang`
    picks that language's temperatures from `lang_temperatures` (`resolve_lang_temperatures`), if any;
    `calibration` (client/calibration.py) replaces the card's temperatures and may rebin `answer_confidence`
    (not for a language with its own temperatures, as in the SDK).
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
        p = softmax_f32(raw, temperature_for(card, qtype, k, lang, lang_temperatures, calibration))
        p = unpermute(p, q.get("option_order"))
        binning = None
        if calibration is not None and calibration.binning_map and lang_override(lang, lang_temperatures) is None:
            binning = (temp_bucket(qtype, k), calibration.binning_map)
        answers[qid] = _answer(q, p, k, act[r], binning)
    return {"model": MODEL_NAME, "answers": answers, "usage": _usage(encoded)}
